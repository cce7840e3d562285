"""Models: the target (Llama / Qwen2 / Mistral family), EAGLE-1 and EAGLE-3 draft heads,
shared layers, checkpoint loading and the tokenizer. Nothing here imports transformers."""
from rocdraft.models.config import HeadConfig, ModelConfig, load_model_config  # noqa: F401
from rocdraft.models.draft_loader import detect_format, load_draft  # noqa: F401
from rocdraft.models.eagle1 import Eagle1Head  # noqa: F401
from rocdraft.models.eagle3 import Eagle3Head  # noqa: F401
from rocdraft.models.llama import LlamaForCausalLM, TargetOutput, load_target  # noqa: F401
from rocdraft.models.tokenizer import Tokenizer, load_tokenizer  # noqa: F401
