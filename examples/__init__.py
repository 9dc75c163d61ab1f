"""Example models and a small serving engine built on fgraph.

  layers.py      shared blocks: RMSNorm, RoPE (incl. Llama-3 scaling), gated MLP, embedding/head
  llama.py       Llama 2/3 and Qwen2/2.5 as one pure decoder step, with presets
  checkpoint.py  Hugging Face model directories (config.json + *.safetensors) -> (config, params)
  engine.py      request queue, paged KV blocks, continuous batching, sampling, metrics
  generate.py    `python -m examples.generate` command line
"""
