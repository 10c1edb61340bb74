"""Weight quantization as a module swap: the quantized layer and its settings (`linear`), the swap (`quantize`), and
AWQ's calibration (`awq`) and files (`awq_file`). Imports `model`, `kv`, the engine's runner for calibration forwards
and the root vocabulary; never `bench` or a front end."""
