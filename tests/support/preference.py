"""Tiny preference data for the post-training tests: a character-level tokenizer (nothing downloaded), prompt /
chosen / rejected pairs of unequal lengths, and TRL configs that give the same global batch on 1 or 4 ranks."""

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TEXT = "the cat sat on the mat, a dog ran to the park. "
BETA = 0.5  # DPO's beta in every test run


def tokenizer():
    """A character-level fast tokenizer with EOS and padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def pairs(n: int = 24) -> dict[str, list[str]]:
    """``n`` preference pairs: prompts, chosen and rejected completions of 2 to 12 characters."""
    text = TEXT * 4
    return {"prompt": [text[i:i + 3 + i % 5] for i in range(n)],
            "chosen": [text[2 * i + 1:2 * i + 3 + (3 * i) % 11] for i in range(n)],
            "rejected": [text[3 * i + 2:3 * i + 5 + (5 * i) % 9] for i in range(n)]}


def dpo_args(out, world: int, total: int = 4, **overrides):
    """DPOConfig for a global batch of ``total`` pairs over ``world`` ranks, 3 steps, every step logged."""
    from trl import DPOConfig

    base = dict(output_dir=str(out), per_device_train_batch_size=total // world, max_steps=3, learning_rate=1e-2,
                logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                max_length=40, bf16=False, beta=BETA, dataloader_drop_last=True)
    return DPOConfig(**{**base, **overrides})


LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
          "logps/rejected", "aux_loss")


def log(trainer) -> list[dict]:
    """The per-step metrics of a trained DPO trainer that the tests compare."""
    return [{k: h[k] for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h]


def prompts(n: int = 8) -> dict[str, list[str]]:
    """``n`` plain-text prompts of 3 to 7 characters."""
    text = TEXT * 2
    return {"prompt": [text[3 * i:3 * i + 3 + i % 5] for i in range(n)]}


def vowels(completions, **kwargs) -> list[float]:
    """A verifiable reward: the number of vowels in each completion."""
    return [float(sum(c in "aeiou" for c in text)) for text in completions]


def grpo_args(out, world: int, total: int = 8, **overrides):
    """GRPOConfig for a global batch of ``total`` completions (groups of 4: a prompt's completions on two ranks of
    4) over ``world`` ranks, 2 steps, every step logged."""
    from trl import GRPOConfig

    base = dict(output_dir=str(out), per_device_train_batch_size=total // world, num_generations=4,
                max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                report_to="none", disable_tqdm=True, use_cpu=True, seed=0, bf16=False)
    return GRPOConfig(**{**base, **overrides})


def grpo_log(trainer) -> list[dict]:
    return [{k: h[k] for k in ("loss", "grad_norm", "reward") if k in h} for h in trainer.state.log_history
            if "loss" in h]
