"""The transformers model types with fused experts (``@use_experts_implementation``) that xpar_zoo refuses, each
with the exact reason. ``get_plan``, ``parallelize`` and ``from_pretrained`` raise
:class:`~xpar_zoo.errors.RefusedArchitectureError` with it; MODEL_CARDS.md lists them."""

REFUSED = {
    "diffusion_gemma": (
        "not a language model xpar_zoo can train: DiffusionGemmaForBlockDiffusion, transformers' only model class "
        "for it, is a block-diffusion denoiser whose forward takes no labels and computes no loss (its training "
        "objective is not in transformers), so there is no loss to train through or to prove parity of"),
    "openai_privacy_filter": (
        "not a language model: transformers ships it only as a token classifier "
        "(OpenAIPrivacyFilterForTokenClassification, no causal-LM, image-text-to-text or multimodal-LM class), "
        "and xpar_zoo loads and trains language models"),
    "qwen3_omni_moe": (
        "Qwen3OmniMoeForConditionalGeneration (thinker + talker + code2wav) has no forward, only generate(), so it "
        "cannot be trained as one model; its language model is the thinker (model_type qwen3_omni_moe_thinker, "
        "Qwen3OmniMoeThinkerForConditionalGeneration), which xpar_zoo trains"),
}
