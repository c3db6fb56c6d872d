from ..cli.train import main  # the command line of `python -m kvpop.train` (torchrun): kvpop.cli.train

raise SystemExit(main())
