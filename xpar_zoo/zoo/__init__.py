"""The zoo: plans as data (:mod:`.plan`), the registry that finds an architecture's plan and builds its model on
meta (:mod:`.registry`), and the table of what each architecture is proved on (:mod:`.proofs`),
and model configs read without running anything from a model directory (:mod:`.configs`)."""
