"""Weight quantization as a module swap: the quantized layer and its settings (`linear`), the swap (`quantize`), and
the calibrated int4 methods, AWQ (`awq`) and GPTQ (`gptq`), with their files (`calibrated_file`). Imports `model`,
`kv`, the engine's runner for calibration forwards and the root vocabulary; never `bench` or a front end."""
