"""The ``xpar-zoo`` command line: cli (the entry point), demo, sizing, model cards, publish."""
