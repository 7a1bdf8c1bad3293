"""The zoo: one small declarative module per architecture, each defining ``PLAN``."""
