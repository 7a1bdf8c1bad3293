"""Glue to the libraries users already fine-tune with: PEFT (:mod:`xpar_zoo.integrations.peft`)."""
