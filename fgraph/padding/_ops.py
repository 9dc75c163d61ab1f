"""The aten ops the padding check (fgraph/padding/_mixing.py) treats by kind, keyed by schema name (`aten.mean.dim` ->
"mean"): the rules are in find_mixing, the tables here."""

# ops that combine rows along their `dim` / `dims` argument (the axis keeps its size). Running ones (cumsum, cummax,
# ...) are not among them: a row's result depends only on the rows before it, and padded rows come after the real
# ones (or something earlier was reported for putting them before)
_ALONG = {
    "_softmax",
    "_log_softmax",
    "softmax",
    "log_softmax",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "median",
    "mode",
    "flip",
    "roll",
}
# batch norm in training mode: statistics over every dim but the channels (1): its output keeps the axis
_BATCH_STATS = {"_native_batch_norm_legit", "native_batch_norm", "_batch_norm_with_update", "batch_norm"}
# (op, index of the operand whose dim is contracted, that dim)
_CONTRACT = {"mm": (0, 1), "bmm": (0, 2), "addmm": (1, 1), "baddbmm": (1, 2), "addbmm": (1, 2), "mv": (0, 1)}
_CONTRACT.update({"dot": (0, 0), "vdot": (0, 0), "addmv": (1, 1)})
# ops that read rows by index or only read metadata: they do not combine rows
_READS = {"index", "index_select", "gather", "take", "take_along_dim", "embedding", "select", "slice", "narrow"}
_READS |= {"unbind", "split", "split_with_sizes", "unsafe_split", "chunk", "as_strided", "expand", "copy_", "copy"}
# layout ops that can put padded rows before real ones along a batch-sized dim (real rows no longer a prefix)
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
# ops sliding a window along their spatial dims (2 on, after batch and channels)
_WINDOWS = {"convolution", "_convolution", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "avg_pool3d"}
_WINDOWS |= {"max_pool2d_with_indices", "max_pool3d_with_indices", "_adaptive_avg_pool2d", "adaptive_max_pool2d"}
_SCATTERS = {"index_put", "index_put_", "index_copy", "index_copy_", "index_add", "index_add_", "scatter", "scatter_"}
_SCATTERS |= {"scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "_unsafe_index_put"}
_SCATTERS |= {"index_fill", "index_fill_"}
# ops indexing a tensor by index tensors, whose values fgraph/padding/_index_rules.py checks along the batch axis
_INDEXES = _SCATTERS | {"index", "_unsafe_index", "take"}


# ops that mix rows along the dims these return, for an input of `ndim` dims, though they keep every dim's size
def _last(k):
    return lambda node, ndim: set(range(max(ndim - k, 0), ndim))


def _normalized(node, ndim):
    return set(range(ndim - len(node.args[1]), ndim))  # native_layer_norm(input, normalized_shape, ...)


def _fft_dims(node, ndim):
    return {d % ndim for d in node.args[1]}  # _fft_*(self, dim, ...)


_SPANS = {"native_layer_norm": _normalized, "native_group_norm": lambda node, ndim: set(range(1, ndim))}
_SPANS.update({f"{kind}_pad{k}d": _last(k) for kind in ("replication", "reflection") for k in (1, 2, 3)})
_SPANS.update({name: _fft_dims for name in ("_fft_r2c", "_fft_c2c", "_fft_c2r")})
_SPANS.update({name: _last(2) for name in ("linalg_inv_ex", "_linalg_det", "_linalg_slogdet", "linalg_lu_factor_ex")})
_SPANS.update(
    {"_pdist_forward": lambda node, ndim: {0}, "renorm": lambda node, ndim: set(range(ndim)) - {node.args[2]}}
)
# ops whose scalar arguments are values (`x * x.shape[0]`, `arange(n) == n - 1`, `clamp(max=n - 1)`): a size taken
# there is the bucket's, where shapes (`view(n, -1)`, `arange(n)`) keep the call's rows a prefix
_VALUES = {"mul", "div", "add", "sub", "rsub", "pow", "remainder", "fmod", "floor_divide", "clamp", "clamp_min"}
_VALUES |= {"clamp_max", "eq", "ne", "lt", "le", "gt", "ge", "where", "masked_fill", "fill", "full", "scalar_tensor"}
_VALUES |= {"minimum", "maximum", "lerp", "addcmul", "addcdiv", "mul_", "add_", "sub_", "div_", "fill_"}
