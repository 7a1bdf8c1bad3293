"""Glue for the fine-tuning tools people already use: :mod:`~xpar_zoo.integrations.trainer` (transformers'
``Trainer`` and trainers built on it, such as TRL's ``SFTTrainer``) and :mod:`~xpar_zoo.integrations.accelerate`.
PEFT LoRA under the plans lives where its layer is: :mod:`xpar_zoo.styles.lora` and :mod:`xpar_zoo.hub.adapter_files`."""
