"""The parallel layer: meshes, coordination across ranks (same-on-all-ranks checks, broadcast, rendezvous),
collectives, FSDP2 units and their placement, gradient clipping, materializing a meta model, and the CPU-only
in-place gloo collectives."""
