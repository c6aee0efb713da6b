"""protocols.from_openai_logprobs on responses recorded from kvdiv's own server
(tests/data/openai_logprobs_smollm2.json, written by tests/record_openai_fixture.py), and its refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

import divstats as dv
from protocols import ConversionError, from_openai_logprobs, validate

FIXTURE = Path(__file__).resolve().parent / "data" / "openai_logprobs_smollm2.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _convert(rec: dict, **kw):
    args = dict(vocab_size=rec["vocab_size"], token_ids=rec["token_ids"], eos_token_ids=rec["eos_token_ids"],
                model=rec["model"])
    args.update(kw)
    return from_openai_logprobs(rec["samples"], {p: rec["scores"][p] for p in rec["policies"]}, **args)


def test_recorded_scores_replay_the_servers_decoding(recorded: dict) -> None:
    """The recorder's teacher forcing reproduced the server's own log-probabilities, for the full
    model's samples and for each policy decoding by itself: the scores are the server's models."""
    assert recorded["replay_max_abs_diff_full"] <= 1e-5
    assert set(recorded["replay_max_abs_diff_policy_decoding"]) == set(recorded["policies"])
    assert max(recorded["replay_max_abs_diff_policy_decoding"].values()) <= 1e-5


def test_recorded_responses_become_a_reference_dataset(recorded: dict) -> None:
    ds = _convert(recorded)
    validate(ds)
    assert ds.attrs["kind"] == "reference"
    assert dict(ds.x_token.sizes) == {"doc": 2, "policy": 2, "replicate": 2, "step": recorded["max_tokens"]}
    assert ds["policy"].values.tolist() == recorded["policies"]
    for d, doc in enumerate(recorded["samples"]):
        for r, resp in enumerate(recorded["samples"][doc]):
            content = resp["choices"][0]["logprobs"]["content"]
            ids = [recorded["token_ids"][e["token"]] for e in content]
            for p, pol in enumerate(recorded["policies"]):
                cell = ds.isel(doc=d, policy=p, replicate=r)
                assert cell.x_token.values.tolist() == ids
                np.testing.assert_allclose(cell.x_logp, [e["logprob"] for e in content], rtol=1e-6)
                np.testing.assert_allclose(cell.x_logq, [e["logprob"] for e in recorded["scores"][pol][doc][r]],
                                           rtol=1e-6)
    # the ids are the server's: the chat text is their decoding, so the tokens spell the message
    text = "".join(e["token"] for e in recorded["samples"]["tea"][1]["choices"][0]["logprobs"]["content"])
    assert text == recorded["samples"]["tea"][1]["choices"][0]["message"]["content"]


def test_recorded_set_feeds_the_speculative_estimator(recorded: dict) -> None:
    spec = dv.speculative(_convert(recorded), gamma=(1, 4))
    tpc = spec["tokens_per_call"].values
    assert np.isfinite(tpc).all() and (tpc >= 1).all() and (tpc <= 1 + spec["gamma"].values).all()
    # the full model scoring its own samples accepts every draft: (γ + 1) tokens per call up to the cut
    own = from_openai_logprobs(recorded["samples"], {"full": {d: [s["choices"][0]["logprobs"]["content"]
                                                                  for s in ss]
                                                              for d, ss in recorded["samples"].items()}},
                               vocab_size=recorded["vocab_size"], token_ids=recorded["token_ids"],
                               eos_token_ids=recorded["eos_token_ids"])
    calls = dv.speculative(own, gamma=4)["target_calls"].values
    np.testing.assert_allclose(calls, np.ceil(recorded["max_tokens"] / 5))


def test_horizon_cuts_and_short_samples_are_refused(recorded: dict) -> None:
    assert _convert(recorded, horizon=10).sizes["step"] == 10
    where = r"sample scored by\['snapkv@0.5'\]\['fox'\]\[0\]"
    with pytest.raises(ConversionError, match=where + ".*fewer than the horizon"):
        _convert(recorded, horizon=30)


def test_refusals_name_the_response(recorded: dict) -> None:
    pols = {p: recorded["scores"][p] for p in recorded["policies"]}
    with pytest.raises(ConversionError, match=r"samples\['fox'\]\[0\]: logprobs.content\[0\].token = .* token_ids="):
        from_openai_logprobs(recorded["samples"], pols, vocab_size=recorded["vocab_size"])
    bad = copy.deepcopy(pols)
    bad["recent@0.5"]["tea"][1][3]["token"] = "###"
    with pytest.raises(ConversionError, match=r"scores\['recent@0.5'\]\['tea'\]\[1\]: token 3 is '###'"):
        from_openai_logprobs(recorded["samples"], bad, vocab_size=recorded["vocab_size"],
                             token_ids=recorded["token_ids"])
    missing = {"snapkv@0.5": {"fox": pols["snapkv@0.5"]["fox"]}}
    with pytest.raises(ConversionError, match=r"no scores for doc 'tea'"):
        from_openai_logprobs(recorded["samples"], missing, vocab_size=recorded["vocab_size"],
                             token_ids=recorded["token_ids"])
    short = copy.deepcopy(pols)
    short["snapkv@0.5"]["fox"][0] = short["snapkv@0.5"]["fox"][0][:5]
    with pytest.raises(ConversionError, match=r"5 log-probabilities for the sample's 24 tokens"):
        from_openai_logprobs(recorded["samples"], short, vocab_size=recorded["vocab_size"],
                             token_ids=recorded["token_ids"])
    no_lp = copy.deepcopy(recorded["samples"])
    no_lp["fox"][1]["choices"][0]["logprobs"] = None
    with pytest.raises(ConversionError, match=r"samples\['fox'\]\[1\]: no logprobs.content"):
        from_openai_logprobs(no_lp, pols, vocab_size=recorded["vocab_size"], token_ids=recorded["token_ids"])


def _response(tokens: list[str], logprobs: list[float], finish: str) -> dict:
    return {"choices": [{"finish_reason": finish, "logprobs": {"content": [
        {"token": t, "logprob": v} for t, v in zip(tokens, logprobs, strict=True)]}}]}


def test_eos_pads_and_token_id_spelling() -> None:
    # kvdiv's server puts the EOS token in logprobs.content; the path ends there and is padded
    stop = _response(["token_id:5", "token_id:2"], [-0.5, -1.0], "stop")
    long = _response(["token_id:5", "token_id:6", "token_id:7"], [-0.5, -0.25, -0.125], "length")
    ds = from_openai_logprobs({"d": [stop, long]}, {"q": {"d": [[-0.5, -np.inf], [-1.0, -0.25, -0.5]]}},
                              vocab_size=8, eos_token_id=2)
    assert ds.x_token.values[0, 0].tolist() == [[5, 2, 2], [5, 6, 7]]
    assert ds.x_logq.values[0, 0, 0].tolist() == [-0.5, -np.inf, 0.0]
    spec = dv.speculative(ds, gamma=2).squeeze()
    assert float(spec["tokens"]) == 2.5
    with pytest.raises(ConversionError, match="finish_reason 'stop'.*eos_token_id="):
        from_openai_logprobs({"d": [stop]}, {"q": {"d": [[-0.5, -1.0]]}}, vocab_size=8)
