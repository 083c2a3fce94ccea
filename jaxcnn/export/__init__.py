"""Deployment: StableHLO and ONNX export, BatchNorm folding, int8 quantisation, pruning.

* :func:`export_stablehlo` / :func:`load_stablehlo`: a self-contained
  ``jax.export`` module with a symbolic batch dimension;
* :func:`export_onnx`: an ONNX graph (opset 17+) written with the ``onnx``
  helper API, input NHWC by default (NCHW on request);
* :func:`fold_batch_norm`: BatchNorm folded into the preceding convolution;
* :func:`quantize_int8`: post-training int8 (per-channel weights, calibrated
  activations, integer convolutions), exported to ONNX in QDQ form;
* :func:`magnitude_prune`, :func:`sparsity_report`, and :func:`fine_tune`, which
  prunes a trained run and fine-tunes it with the trainer (``prune:`` config);
* :func:`export`: all of it from a run directory or parameter file, as the
  ``jaxcnn-export`` command line does (:mod:`jaxcnn.export.cli`).
"""
from jaxcnn.errors import ExportError
from jaxcnn.export.fold import fold_batch_norm
from jaxcnn.export.onnx_export import export_onnx, supported_kinds
from jaxcnn.export.pipeline import Source, calibration_batches, evaluate_model, export, load_source
from jaxcnn.export.prune import apply_masks, fine_tune, magnitude_prune, sparsity_report
from jaxcnn.export.quantize import calibrate, quantize_int8
from jaxcnn.export.stablehlo import export_stablehlo, load_stablehlo

__all__ = [
    "ExportError", "export", "load_source", "Source", "export_stablehlo", "load_stablehlo",
    "export_onnx", "supported_kinds", "fold_batch_norm", "quantize_int8", "calibrate",
    "calibration_batches", "magnitude_prune", "apply_masks", "fine_tune", "sparsity_report",
    "evaluate_model",
]
