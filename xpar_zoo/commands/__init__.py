"""The ``xpar-zoo`` command line: cli (the entry point, with the thin ``size`` command over :mod:`xpar_zoo.sizing`),
demo, model cards, publish."""
