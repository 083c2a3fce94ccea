"""Moving parameters in and out of jaxcnn.

* :mod:`jaxcnn.interop.arrays`: ``(params, state)`` to and from ``.npz`` and
  ``.safetensors`` files (flat ``params/a.b.c`` keys).
* :mod:`jaxcnn.interop.torch`: zoo-model parameters to and from PyTorch
  ``state_dict`` form (torch is imported lazily, only when needed), and PyTorch
  state dicts saved as safetensors (torchvision/timm names).
"""
from jaxcnn.interop.arrays import load_npz, load_safetensors, save_npz, save_safetensors
from jaxcnn.interop.torch import (from_torch_state_dict, is_torch_safetensors,
                                  load_torch_safetensors, match_state_dict, to_torch_state_dict)

__all__ = ["save_npz", "load_npz", "save_safetensors", "load_safetensors",
           "from_torch_state_dict", "to_torch_state_dict", "match_state_dict",
           "is_torch_safetensors", "load_torch_safetensors"]
