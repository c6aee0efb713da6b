"""The one error base of the ``collector`` package.

Every exception that the collector raises on purpose derives from
:class:`CollectorError`, so ``kvdiv collect`` and ``kvdiv pack`` turn any of them into
one line naming the file and the problem. Classes that replace a ``ValueError`` of
earlier versions keep ``ValueError`` as a second base.

=========================  ===========================================================
class                      raised for
=========================  ===========================================================
:class:`ConfigError`       collection parameters that cannot work (``CollectConfig``)
:class:`DocumentsError`    a document set that cannot be read (bad JSONL, duplicate ids)
:class:`JournalError`      a run directory whose manifest, documents or request files
                           are unreadable or disagree with each other
:class:`ManifestMismatch`  a resume asking for other parameters than the run's manifest
:class:`PackError`         a run that cannot be packed as asked (gaps, refused requests)
:class:`RetryableError`    one attempt of one request failed; another may succeed
:class:`PermanentError`    one request failed in a way another attempt cannot fix
=========================  ===========================================================
"""

from __future__ import annotations

__all__ = [
    "CollectorError", "ConfigError", "DocumentsError", "JournalError", "ManifestMismatch", "PackError",
    "PermanentError", "RetryableError",
]


class CollectorError(Exception):
    """Base of every error the ``collector`` package raises on purpose.

    Examples
    --------
    >>> from collector.errors import CollectorError, PackError
    >>> issubclass(PackError, CollectorError)
    True
    """


class ConfigError(CollectorError, ValueError):
    """Collection parameters that cannot work; the message lists every problem."""


class DocumentsError(CollectorError, ValueError):
    """A document set that cannot be read; the message names the file and line."""


class JournalError(CollectorError):
    """A run directory (manifest, documents, request files) that is unreadable or inconsistent."""


class ManifestMismatch(JournalError):
    """A resume asked for parameters that differ from the run's manifest."""


class PackError(CollectorError):
    """A run that cannot be packed as asked (missing requests, refused streams, bad output)."""


class RetryableError(CollectorError):
    """One attempt failed in a way another attempt may fix (overload, connection loss, bad stream).

    Parameters
    ----------
    message : str
        What went wrong.
    retry_after : float, optional
        The server's ``Retry-After``, in seconds.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentError(CollectorError):
    """A failure another attempt cannot fix (a refused request, a header that answers another request).

    Parameters
    ----------
    message : str
        What went wrong, naming the field.
    fatal : bool
        A failure every request would share (authentication): stop the whole collection.
    """

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal
