"""The zoo: plans as data (:mod:`.plan`), the registry that finds an architecture's plan and builds its model on
meta (:mod:`.registry`), and the table of what each architecture is proved on (:mod:`.proofs`)."""
