import torch, time, operator
from benchmarks import hf_host
from examples import hf_generate
torch.set_num_threads(1)
model = hf_host.make_model()
hf_generate.jit_forward(model, "FULL_AND_PIECEWISE", buckets=[1, 8])
ids = torch.randint(0, 256, (1, 32))
def gen(n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True, cache_implementation="static")
gen(40); gen(40)
jitted = model.forward; seen = []
fp = jitted.fastpath; find = fp.find
fp.find = lambda a, k, v=None: seen.append((a, k)) or find(a, k, v)
gen(8); fp.find = find
a, k = seen[-1]
def t(name, f, n=5000):
    for _ in range(200): f()
    best = 1e9
    for r in range(5):
        t0 = time.thread_time()
        for _ in range(n): f()
        best = min(best, (time.thread_time()-t0)/n*1e6)
    print(f"{name:14s} {best:.2f} us")
with torch.no_grad():
    v = jitted._view
    hit = find(a, k, v); e = hit.entry
    graphs = [e.full] if e.full is not None else e.graphs
    for g in graphs: g.fn = lambda *x, out=g.out: out
    print("mode", e.full is not None, "slots copied", e.slots.copied if e.slots else None, "out_args", e.out_args, "batched_ix", e.batched_ix)
    t("call", lambda: jitted(*a, **k))
    t("find", lambda: find(a, k, v))
    t("proven", v.proven)
    t("find-noview", lambda: find(a, k, None))
    t("binder", lambda: fp.binder.arguments(a, k))
    t("run", lambda: e.run(hit.leaves, hit.n, hit.bound, False))
    outs = [g.out for g in graphs][0]
    t("outputs", lambda: e._outputs(hit.leaves, hit.n, hit.bound, outs, False))
    t("unflatten", lambda: e.unflatten(iter(list(outs))))
    t("write", lambda: e.buffers.write([hit.leaves[i] for i in e.batched_ix], e.specs, in_graph=False))
    for name, c in fp.layouts.items():
        if c.guard: t("guard:"+name, lambda: c.guard(k[name] if name in k else None))
    print(type(hit.bound['cache']), len(hit.leaves))
