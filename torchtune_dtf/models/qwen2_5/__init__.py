from torchtune_dtf.models.qwen2_5._component_builders import lora_routed_qwen2, routed_qwen2
from torchtune_dtf.models.qwen2_5._model_builders import *  # noqa: F401,F403  (the builder names)
from torchtune_dtf.models.qwen2_5._model_builders import QWEN2_5_SHAPES
from torchtune_dtf.models.qwen2_5._tokenizer import Qwen2_5BaseTokenizer, qwen2_5_base_tokenizer
