from ..cli.adapt import main  # the command line of `python -m kvpop.adapt` (torchrun): kvpop.cli.adapt

raise SystemExit(main())
