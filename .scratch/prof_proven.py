import torch, time, operator
from benchmarks import hf_host
from examples import hf_generate
from fgraph.trace import _lifted_view as LV
torch.set_num_threads(1)
model = hf_host.make_model()
hf_generate.jit_forward(model, "FULL_AND_PIECEWISE", buckets=[1, 8])
ids = torch.randint(0, 256, (1, 32))
with torch.no_grad():
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, disable_compile=True, cache_implementation="static")
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, disable_compile=True, cache_implementation="static")
v = model.forward._view
print("tensors", len(v.tensors), "modules", len(v.modules), "slots", len(v.slots), "guards", len(v.guards))
is_ = operator.is_
def t(name, f, n=20000):
    for _ in range(100): f()
    t0 = time.thread_time()
    for _ in range(n): f()
    print(f"{name:12s} {(time.thread_time()-t0)/n*1e6:.2f} us")
t("proven", v.proven)
t("identity", lambda: all(map(is_, map(LV._getitem, v.dicts, v.keys), v.tensors)))
t("data_ptr", lambda: list(map(LV._data_ptr, v.tensors)) != v.ptrs)
t("flags", lambda: list(map(LV._flag, v.flags)) == v.training)
t("sizes", lambda: list(map(len, v.children)) == v.sizes)
