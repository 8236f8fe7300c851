"""Frontend: tokenizer and chat template from the artifact resources."""

from ninfer_offload.frontend.chat_template import ChatTemplate
from ninfer_offload.frontend.detokenizer import IncrementalDecoder
from ninfer_offload.frontend.frontend import Frontend

__all__ = ["ChatTemplate", "Frontend", "IncrementalDecoder"]
