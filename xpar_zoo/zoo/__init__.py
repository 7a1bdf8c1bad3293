"""The zoo: plans as data (:mod:`.plan`), the registry that finds an architecture's plan and builds its model on
meta (:mod:`.registry`), and model configs read without running anything from a model directory (:mod:`.configs`)."""
