from kvdiv.cli import main

main()
