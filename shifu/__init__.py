"""shifu: PPO-RLHF."""

import os as _os

# No network at run time: every model and tokenizer comes from a local directory. Set here, before any
# shifu module can import transformers / huggingface_hub (which read it once, at import).
_os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"
