"""Weight quantization as a module swap: `quantize(loaded, QuantConfig(...))` returns a LoadedModel whose every
`Linear` (the LM head too, unless `lm_head=False`) is a `QuantLinear`; embeddings and norms stay in the model dtype
and are shared with the original, which is left as it was (the playground keeps both, one per lane). Schemes `awq`
and `gptq` load (or calibrate once and save) calibrated int4 weights through `inference_core.quant.calibrated_file`.
Quantized weights run on the CPU and on CUDA; `inference_core.quant.kernels` owns the kernels of each.
"""

from __future__ import annotations

import dataclasses

from inference_core.quant.calibrated_file import load_or_calibrate
from inference_core.quant.kernels import check_device
from inference_core.quant.linear import CALIBRATED, QuantConfig, quantize_projections, shared_copy


def quantize(loaded, config: QuantConfig):
    """A LoadedModel with `config`'s quantized projections, sharing every other tensor with `loaded`."""
    if config.scheme == "none":
        return loaded
    check_device(loaded.device)
    if config.scheme in CALIBRATED:
        return load_or_calibrate(loaded, config)
    model = shared_copy(loaded.model)
    quantize_projections(model, config, loaded.device.type, loaded.dtype, skip=() if config.lm_head else ("lm_head",))
    return dataclasses.replace(loaded, model=model, quant=config)
