"""``python -m xpar_zoo.train ARGS`` = ``xpar-zoo train ARGS`` (the command line is the one entry point; this
module, which nothing imports, hands it the arguments)."""

import sys

from ..commands.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
