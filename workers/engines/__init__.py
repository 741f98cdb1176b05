"""Inference engines as members of the mesh: vLLM through its KV connector (`engine`
holds everything that is kvmesh's, `vllm_connector` the thin vLLM side)."""
