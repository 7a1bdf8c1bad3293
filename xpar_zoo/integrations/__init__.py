"""Glue for the fine-tuning tools people already use: :mod:`~xpar_zoo.integrations.peft` (PEFT LoRA under the
plans), :mod:`~xpar_zoo.integrations.trainer` (transformers' ``Trainer`` and trainers built on it, such as TRL's
``SFTTrainer``) and :mod:`~xpar_zoo.integrations.accelerate`."""
