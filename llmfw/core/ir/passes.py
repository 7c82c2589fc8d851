"""The core passes: one compiler, shared by every backend (see the top of :mod:`llmfw.core.ir.graph`).

Run once per built graph (:meth:`llmfw.core.exec.scheduler.Scheduler.plan`; :func:`optimize` runs both on a graph
for one backend):

* :func:`fuse_shared_input_matmuls` — ``mul_mat``s that multiply one input by weights prepared as one fused
  weight become one ``mul_mat`` on that ``weight`` (attrs ``name="a+b+c"``, ``parts=(a, b, c)``), followed by
  one ``slice`` per part. Which groups are fused is decided once, at load (:func:`prepare_fused_weights`): the
  same detection runs on a representative graph, splits each group into the sub-groups whose weights its
  backend can stack together (:meth:`llmfw.core.exec.backend.Backend.fusion_key`, e.g. one quant layout each) and
  asks the backend to build each sub-group's fused weight (:meth:`llmfw.core.exec.backend.Backend.fuse_weights`,
  False = it cannot);
* :func:`fold_norm_weights` — after placement: a norm whose only consumer multiplies it by a 1-D weight on the
  same backend becomes ``rms_norm(x, w)`` / ``norm(x, w)`` (a norm placed elsewhere keeps running there).

After placement, per split (:func:`apply_rewrite_rules`): the rewrite rules the split's backend declares
(:class:`RewriteRule`, a pattern of core ops → one op the backend implements). Liveness
(:func:`llmfw.core.ir.graph.last_uses`) and the consumer map (:func:`llmfw.core.ir.graph.consumers_of`) are in
:mod:`llmfw.core.ir.graph`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Collection, Hashable, Mapping, Protocol, Sequence

from .graph import BuildParams, Graph, GraphBuilder, GraphModel, Node, consumers_of, infer_type

log = logging.getLogger(__name__)

#: fused weights a model prepared at load: part names (graph order) → the fused weight's name
FusedWeights = Mapping[tuple[str, ...], str]
#: a weight name → the key of the weights it may be fused with (None: never fused; see Backend.fusion_key)
FusionKeyOf = Callable[[str], Hashable | None]


def fused_weight_name(parts: Sequence[str]) -> str:
    return "+".join(parts)


# ---------------------------------------------------------------------------------------------------------
# matmuls sharing an input
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatmulGroup:
    """``mul_mat`` nodes (graph order) that multiply the same activations by different weights."""

    members: tuple[Node, ...]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(str(m.inputs[0].attrs["name"]) for m in self.members)

    @property
    def name(self) -> str:
        return fused_weight_name(self.parts)


def matmul_groups(graph: Graph, backend_of: Callable[[str], object],
                  key_of: FusionKeyOf = lambda name: ()) -> list[MatmulGroup]:
    """Groups of ≥ 2 ``mul_mat``s (graph order) on typed 2-D weights with one input, one ``n_in``, one backend
    and one fusion key (``key_of`` of the weight's name; weights keyed None belong to no group)."""
    by_input: dict[tuple[int, int, int, Hashable], list[Node]] = {}
    for node in graph.nodes:
        weight = node.inputs[0] if node.op == "mul_mat" else None
        if weight is None or weight.op != "weight" or weight.shape is None or len(weight.shape) != 2:
            continue
        name = str(weight.attrs["name"])
        fusion_key = key_of(name)
        if fusion_key is None:
            continue
        key = (node.inputs[1].id, weight.shape[1], id(backend_of(name)), fusion_key)
        by_input.setdefault(key, []).append(node)
    groups = []
    for members in by_input.values():
        names = [m.inputs[0].attrs["name"] for m in members]
        if len(members) > 1 and len(set(names)) == len(names):
            groups.append(MatmulGroup(tuple(members)))
    return groups


def fuse_shared_input_matmuls(graph: Graph, fused: FusedWeights, backend_of: Callable[[str], object]) -> int:
    """Rewrite every group whose parts were prepared as a fused weight; returns how many were fused."""
    if not fused:  # nothing was prepared at load (or a maintenance graph of such a model): skip the scan
        return 0
    by_first_part: dict[str, list[tuple[str, ...]]] = {}
    for parts, name in fused.items():
        if parts and name == fused_weight_name(parts):
            by_first_part.setdefault(parts[0], []).append(parts)
    groups = [sub for g in matmul_groups(graph, backend_of) for sub in _prepared_subgroups(g, by_first_part)]
    if not groups:
        return 0
    inserted: dict[int, list[Node]] = {}  # first member id → the fused weight and mul_mat placed before it
    part_weights = {m.inputs[0].id for g in groups for m in g.members}
    for group in groups:
        inserted[group.members[0].id] = _fuse_group(group)
    users = consumers_of(graph.nodes)
    nodes: list[Node] = []
    for node in graph.nodes:
        nodes.extend(inserted.get(node.id, ()))
        if node.id in part_weights and node.id not in users:
            continue  # a part weight nothing reads any more: the fused weight replaced it
        nodes.append(node)
    graph.nodes = nodes
    graph.renumber()
    return len(groups)


def _prepared_subgroups(group: MatmulGroup, by_first_part: Mapping[str, list[tuple[str, ...]]]) -> list[MatmulGroup]:
    """The sub-groups of ``group`` (by fusion key, at load) whose fused weight was prepared: each prepared part
    list, indexed by its first part, whose members all multiply this group's input, in graph order, each member
    in one sub-group at most."""
    position = {part: i for i, part in enumerate(group.parts)}
    taken: set[str] = set()
    subgroups = []
    for part in group.parts:
        for parts in by_first_part.get(part, ()):
            order = [position.get(p, -1) for p in parts]
            if order == sorted(set(order)) and order[0] >= 0 and taken.isdisjoint(parts):
                subgroups.append(MatmulGroup(tuple(group.members[i] for i in order)))
                taken.update(parts)
    return subgroups


def _fuse_group(group: MatmulGroup) -> list[Node]:
    """The fused weight and its ``mul_mat``; each member becomes a ``slice`` of the latter (same id, shape)."""
    first = group.members[0]
    x = first.inputs[1]
    weights = [m.inputs[0] for m in group.members]
    n_in = weights[0].shape[1] if weights[0].shape else 0
    n_out = sum(w.shape[0] for w in weights if w.shape is not None)
    fused_weight = Node(-1, "weight", (), {"name": group.name, "parts": group.parts}, weights[0].layer,
                        group.name, (n_out, n_in), "f32")
    product = Node(-1, "mul_mat", (fused_weight, x), {}, first.layer, "", None, None)
    infer_type(product)
    start = 0
    for member, weight in zip(group.members, weights):
        assert weight.shape is not None
        stop = start + weight.shape[0]
        member.op, member.inputs, member.attrs = "slice", (product,), {"axis": -1, "start": start, "stop": stop}
        infer_type(member)
        start = stop
    return [fused_weight, product]


def prepare_fused_weights(model: "FusingModel", graph: Graph | None = None) -> dict[tuple[str, ...], str]:
    """At load: find the matmul groups of a representative graph (``graph``, built here when not given; the
    detection :func:`optimize` uses) and have each group's backend build its fused weight once. Returns the groups
    it built (parts → name)."""
    graph = graph if graph is not None else representative_graph(model)
    return {} if graph is None else fuse_weight_groups(graph, model.weight_backend)


def fuse_weight_groups(graph: Graph, backend_of: Callable[[str], FusingBackend]) -> dict[tuple[str, ...], str]:
    """Ask each backend to build the fused weight of every group of ``graph``'s matmuls sharing an input whose
    weights it keys alike (:meth:`~llmfw.core.exec.backend.Backend.fusion_key`: a group of mixed quant layouts fuses
    its same-layout subsets). Returns the groups it built (parts → name)."""
    prepared: dict[tuple[str, ...], str] = {}
    for group in matmul_groups(graph, backend_of, lambda name: backend_of(name).fusion_key(name)):
        backend = backend_of(group.parts[0])
        if backend.fuse_weights(group.name, group.parts):
            prepared[group.parts] = group.name
        else:
            log.debug("backend %s does not fuse %s", backend.spec, group.name)
    return prepared


def representative_graph(model: GraphModel) -> Graph | None:
    """One-token graph of the model (every layer's matmuls, one KV cache): what the load-time detection reads.
    None when the architecture cannot build it now (the error then surfaces at the first decode, as before)."""
    builder = GraphBuilder(model, BuildParams(n_tokens=1, n_outputs=1, n_kv=(("kv", 1),)), lambda il: "kv")
    try:
        model.known_arch.build_graph(builder)
    except Exception as exc:  # noqa: BLE001 - detection must not fail a load: the first decode reports it
        log.debug("no representative graph to detect fusable matmuls: %s: %s", type(exc).__name__, exc)
        return None
    return builder.graph


class FusingBackend(Protocol):
    """What weight fusion asks of a backend (:class:`llmfw.core.exec.backend.Backend`, one layer up, has it)."""

    @property
    def spec(self) -> str: ...

    def fusion_key(self, weight_name: str) -> Hashable | None: ...

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool: ...


class FusingModel(GraphModel, Protocol):
    """A model that places weights on backends (what :func:`prepare_fused_weights` needs)."""

    def weight_backend(self, name: str) -> FusingBackend: ...


# ---------------------------------------------------------------------------------------------------------
# norm × weight
# ---------------------------------------------------------------------------------------------------------

def fold_norm_weights(graph: Graph, together: Callable[[Node, Node], bool] = lambda norm, mul: True) -> int:
    """``mul(norm(x), w)`` (either operand order) with ``w`` a 1-D weight of x's last size, the norm read by
    that ``mul`` alone and no graph output → ``norm(x, w)`` in the ``mul``'s place. ``together(norm, mul)``:
    whether both were placed on one backend (the scheduler folds after placement, so a norm that runs where its
    input is, e.g. on the host after the embedding lookup, stays there). Node ids are kept (placement is keyed
    by them). Returns the folds made."""
    users = consumers_of(graph.nodes)
    outputs = {id(n) for n in graph.outputs.values()}
    folded: set[int] = set()
    for node in graph.nodes:
        if node.op not in ("rms_norm", "norm") or len(node.inputs) != 1 or id(node) in outputs:
            continue
        readers = users.get(node.id, [])
        if len(readers) != 1 or readers[0].op != "mul":
            continue
        mul = readers[0]
        weight = mul.inputs[1] if mul.inputs[0] is node else mul.inputs[0]
        if weight is node or not _is_channel_weight(weight, node) or not together(node, mul):
            continue
        mul.op, mul.inputs, mul.attrs = node.op, (node.inputs[0], weight), dict(node.attrs)
        infer_type(mul)
        folded.add(node.id)
    if folded:
        graph.nodes = [n for n in graph.nodes if n.id not in folded]
    return len(folded)


def _is_channel_weight(weight: Node, norm: Node) -> bool:
    """Whether ``weight`` is a 1-D weight of the normalised size (what every backend's norm kernel takes)."""
    if weight.op != "weight" or weight.shape is None or norm.shape is None or len(weight.shape) != 1:
        return False
    return bool(norm.shape) and weight.shape[0] == norm.shape[-1]


# ---------------------------------------------------------------------------------------------------------
# the pass manager
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PassReport:
    """What :func:`optimize` did to one graph (for logs and tests)."""

    fused_matmuls: int
    folded_norms: int


def optimize(graph: Graph, fused: FusedWeights, backend_of: Callable[[str], object]) -> PassReport:
    """Both core passes over a graph that runs on one backend (in place). The scheduler runs them itself, the
    fold after placement (see :meth:`llmfw.core.exec.scheduler.Scheduler.plan`)."""
    report = PassReport(fuse_shared_input_matmuls(graph, fused, backend_of), fold_norm_weights(graph))
    log.debug("core passes: %s", report)
    return report


# ---------------------------------------------------------------------------------------------------------
# rewrite rules declared by backends
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pattern:
    """A tree of core ops: ``Pattern("mul", (Pattern("silu", (ANY,)), ANY))`` is ``silu(a) * b``. ``ANY``
    (None) matches any node and makes it an input of the fused op, in the pattern's left-to-right order."""

    op: str
    inputs: tuple["Pattern | None", ...] = ()


ANY: None = None


@dataclass(frozen=True)
class RewriteRule:
    """A backend's fusion: nodes matching ``pattern`` become one ``op`` node (inputs: the ``ANY`` captures;
    attrs: those of the matched nodes). The fused node keeps the root's id and type — it computes the same value
    — and inner nodes must be read by their parent alone, inside the same split."""

    name: str
    pattern: Pattern
    op: str


def apply_rewrite_rules(nodes: list[Node], rules: Sequence[RewriteRule], keep: Collection[int]) -> list[Node]:
    """Apply ``rules`` to the nodes of one split (topological order); ``keep``: ids that must stay values of
    their own (split outputs, graph outputs). Returns the split's nodes without the absorbed ones."""
    if not rules:
        return nodes
    users = consumers_of(nodes)
    inside = {n.id for n in nodes}
    absorbed: set[int] = set()
    for node in nodes:
        if node.id in absorbed:
            continue
        for rule in rules:
            match = _match(rule.pattern, node, users, inside, keep, is_root=True)
            if match is None:
                continue
            captured, inner = match
            attrs = {key: value for n in [*inner, node] for key, value in n.attrs.items()}
            node.op, node.inputs, node.attrs = rule.op, tuple(captured), attrs
            absorbed.update(n.id for n in inner)
            break
    return [n for n in nodes if n.id not in absorbed]


def _match(pattern: Pattern, node: Node, users: Mapping[int, list[Node]], inside: Collection[int],
           keep: Collection[int], is_root: bool = False) -> tuple[list[Node], list[Node]] | None:
    """(captured inputs, absorbed inner nodes) when ``node`` matches ``pattern``, else None."""
    if node.op != pattern.op or len(node.inputs) != len(pattern.inputs):
        return None
    if not is_root and (node.id not in inside or node.id in keep or len(users.get(node.id, [])) != 1):
        return None
    captured: list[Node] = []
    inner: list[Node] = [] if is_root else [node]
    for inp, sub in zip(node.inputs, pattern.inputs):
        if sub is None:
            captured.append(inp)
            continue
        match = _match(sub, inp, users, inside, keep)
        if match is None:
            return None
        captured += match[0]
        inner += match[1]
    return captured, inner
