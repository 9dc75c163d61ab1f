"""Example models and a small serving engine built on fgraph.

layers.py      shared blocks: RMSNorm, RoPE (incl. Llama-3 scaling), gated MLP, embedding/head
llama.py       Llama 2/3 and Qwen2/2.5 as one pure decoder step, with presets (and mlp / tp hooks)
qwen2_moe.py   Qwen2-MoE and Mixtral: llama's step with a MoE break as its MLP, presets, loader
tp.py          tensor parallelism: sharding, functional collectives, lockstep engine, process launch
ep.py          expert parallelism: the engine that pads the ranks' steps to one signature
checkpoint.py  Hugging Face model directories (config.json + *.safetensors) -> (config, params)
engine.py      continuous batching: scheduling, batches, the overlapped run loop
request.py     a request: prompt, parameters, output, KV pages, timings
block_allocator.py  the free list of KV pages
sampling.py    greedy / temperature / top-p choice of the next token
report.py      what a run hands back: tokens, TTFT / TPOT, throughput
generate.py    `python -m examples.generate` command line (dense, MoE, --tp N)
"""
