"""The runtime both front ends stand on: the engine pool over the one loaded model and its engine loop (`pool`), the
one admission path every request takes before it runs (`admission`), cost estimates from measured steps (`cost`),
the deployment's caps and per-caller limits (`policy`), and the client for an external engine (`remote`). It imports
`inference_core`; never `ui` or `server`, which import it and never each other."""
