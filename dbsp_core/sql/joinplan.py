"""The join planner: a FROM clause's inner joins ordered along their keys, with filters pushed to their inputs and each join input narrowed to the columns read after it.

Invariants:
  1. The result is the FROM clause's bag of rows filtered by the conditions placed here (WHERE conjuncts and the
     ON conjuncts of inner joins); the WHERE conjuncts not placed are returned, in order, for the caller to apply
     after. Moving a condition never changes the bag: inner joins commute and associate, and a filter that reads
     only some inputs commutes with the inner joins of others.
  2. Outer joins (and USING joins) stay where they are in the FROM order: the inner joins before one form a block
     planned on its own, whose result is the left side of the outer join and the first input of the next block.
     A WHERE conjunct moves into an earlier block only if every outer join after that block is a LEFT join (the
     block is on the side that keeps its rows); otherwise it applies after the last RIGHT or FULL join.
  3. A condition is placed only when every column it names resolves to exactly one input of the whole FROM
     clause, and it holds no subquery; anything else (outer references of a correlated subquery, ambiguous or
     unknown names, constants) is left to the caller, where it is resolved and reported as before. An inner
     join's ON conjunct that names something not among the inputs up to its join plans the whole FROM clause
     in the written order instead (the errors are then those of that order).
  4. Order (no statistics: sizes are unknown when a view compiles). An input's estimate is 100 rows times a
     selectivity per pushed filter: 0.1 for ``column = constant``, 0.25 for IN lists, BETWEEN and IS NULL, 0.5 for
     any other. A component grows from its smallest input, each time with the smallest input that an unused
     equality connects to it (ties: more keys, then FROM order). When no input connects, the component is done
     and the next starts from the smallest input left. Components are then joined smallest first, a component
     that a remaining condition connects before one none does; only there a cross product is built.
  5. Each input of a join keeps the columns that are read after it: by the SELECT list, GROUP BY, HAVING, ORDER
     BY, the unplaced WHERE conjuncts, the ON and USING of outer joins, subqueries anywhere in the SELECT, and the
     conditions not applied yet. ``*`` and ``t.*`` keep every column they list. A select narrows a stream only
     when it drops a field.
  6. Every planned FROM clause of two or more inputs adds its plan (order, keys, pushed filters, kept columns) to
     ``builder.notes``, which ``dbsp sql`` prints under the view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc
from sqlglot import exp

from dbsp_core.sql.build import Builder
from dbsp_core.sql.parse import DIALECT, ident, tname
from dbsp_core.sql.relation import Rel
from dbsp_core.sql.walk import columns_of, conjuncts, has_subquery, resolves

F = pc.field
_ROWS = 100.0  # the size every input is assumed to have (invariant 4)


def _sql(node: exp.Expression) -> str:
    return " ".join(node.sql(dialect=DIALECT).split())


@dataclass
class _Needs:
    """The column names read after a point (invariant 5): qualified, unqualified, and what stars list."""

    qualified: set[tuple[str, str]] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    star_tables: set[str] = field(default_factory=set)
    star: bool = False

    def add_column(self, col: exp.Column) -> None:
        if isinstance(col.this, exp.Star):
            if col.args.get("table"):
                self.star_tables.add(tname(col.args["table"]))
            else:
                self.star = True
            return
        name = ident(col.this)
        if col.args.get("table"):
            self.qualified.add((tname(col.args["table"]), name))
        else:
            self.names.add(name)

    def add(self, node: exp.Expression, skip: set[int], scope: exp.Expression | None = None) -> None:
        """Every column ``node`` names (subqueries included), except under the nodes whose ids are in ``skip``; a bare
        ``*`` counts only in the SELECT list of ``scope`` (COUNT(*) reads no column, a subquery's ``*`` its own)."""
        stack: list[Any] = [node]
        while stack:
            n = stack.pop()
            if not isinstance(n, exp.Expression) or id(n) in skip:
                continue
            if isinstance(n, exp.Star) and n.parent is scope:
                self.star = True
            elif isinstance(n, exp.Column):
                self.add_column(n)
                continue
            stack.extend(n.iter_expressions())

    def union(self, other: "_Needs") -> "_Needs":
        return _Needs(self.qualified | other.qualified, self.names | other.names,
                      self.star_tables | other.star_tables, self.star or other.star)

    def keeps(self, table: str | None, name: str) -> bool:
        return (self.star or (table is not None and table in self.star_tables) or name in self.names
                or (table is not None and (table, name) in self.qualified))


@dataclass
class _Input:
    """One input of a block: a relation, the FROM leaves it covers (indexes), its label and estimate."""

    rel: Rel
    leaves: frozenset[int]
    label: str
    pos: int
    est: float = _ROWS
    notes: list[str] = field(default_factory=list)
    origin: list[tuple[int, int]] = field(default_factory=list)  # per column: (FROM position, index) it came from

    def __post_init__(self) -> None:
        if not self.origin:
            self.origin = [(self.pos, i) for i in range(len(self.rel.cols))]


@dataclass
class _Cond:
    """A condition placed in a block: its node, the leaves it reads, and for an equality the leaves of each side."""

    node: exp.Expression
    leaves: frozenset[int]
    sides: tuple[frozenset[int], frozenset[int]] | None = None
    done: bool = False


def _selectivity(c: exp.Expression) -> float:
    if isinstance(c, exp.EQ) and (not columns_of(c.this) or not columns_of(c.expression)):
        return 0.1
    if isinstance(c, (exp.In, exp.Between, exp.Is)):
        return 0.25
    return 0.5


def _label(rel: Rel, node: exp.Expression) -> str:
    tables = sorted(rel.tables())
    if isinstance(node, exp.Table) and len(tables) == 1:
        return tables[0]
    alias = node.args.get("alias")
    return tname(alias.this) if alias is not None and alias.this is not None else "(" + ", ".join(tables) + ")"


class _FromPlan:
    """One FROM clause being planned (invariants 1-6)."""

    def __init__(self, b: Builder, node: exp.Select, where: list[exp.Expression]) -> None:
        self.b, self.node, self.where = b, node, where
        from_ = node.args["from_"]
        self.joins: list[exp.Join] = list(node.args.get("joins") or [])
        self.leaf_nodes = [from_.this] + [j.this for j in self.joins]
        self.leaves = [b.table_ref(from_.this)]
        for j in self.joins:
            right = b.table_ref(j.this)
            seen = set().union(*(r.tables() for r in self.leaves))
            clash = seen & right.tables()
            if clash:
                raise b.src.error(j, f"table name {sorted(clash)[0]!r} appears twice in FROM; give one an alias")
            self.leaves.append(right)
        self.notes: list[str] = []

    # ---- where a condition's columns live ----

    def leaves_of(self, c: exp.Expression) -> frozenset[int] | None:
        """The leaves ``c`` reads; None when it holds a subquery or a name that resolves to no leaf or several."""
        if has_subquery(c):
            return None
        out = set()
        for col in columns_of(c):
            if isinstance(col.this, exp.Star):
                return None
            hits = [i for i, rel in enumerate(self.leaves) if resolves(rel, col)]
            if len(hits) != 1:
                return None
            out.add(hits[0])
        return frozenset(out)

    def cond(self, c: exp.Expression, leaves: frozenset[int]) -> _Cond:
        sides = None
        if isinstance(c, exp.EQ):
            a, bb = self.leaves_of(c.this), self.leaves_of(c.expression)
            if a and bb and not (a & bb):
                sides = (a, bb)
        return _Cond(c, leaves, sides)

    # ---- the plan ----

    @staticmethod
    def is_inner(j: exp.Join) -> bool:
        side = (j.args.get("side") or "").upper()
        kind = (j.args.get("kind") or "").upper()
        return (side in ("", "INNER") and kind in ("", "INNER", "CROSS") and not j.args.get("method")
                and not j.args.get("using"))

    def plan(self) -> tuple[Rel, list[exp.Expression]] | None:
        """The planned FROM clause and the WHERE conjuncts left; None when invariant 3 asks for the written order."""
        # blocks: lists of leaf indexes; barriers[k] is the join between block k and block k + 1
        if not self.joins:
            return self.leaves[0], self.where
        blocks: list[list[int]] = [[0]]
        barriers: list[exp.Join] = []
        block_conds: list[list[_Cond]] = [[]]
        for i, j in enumerate(self.joins, start=1):
            if self.is_inner(j):
                blocks[-1].append(i)
                for c in conjuncts(j.args.get("on")):
                    leaves = self.leaves_of(c)
                    if leaves is None or not leaves <= set(blocks[-1]) | self.before(blocks):
                        return None
                    block_conds[-1].append(self.cond(c, leaves))
            else:
                barriers.append(j)
                blocks.append([i])
                block_conds.append([])
        # the earliest block a WHERE conjunct may move into (invariant 2)
        floor = 0
        for k, j in enumerate(barriers):
            if (j.args.get("side") or "").upper() in ("RIGHT", "FULL"):
                floor = k + 1
        rest = []
        for c in self.where:
            leaves = self.leaves_of(c)
            if not leaves:
                rest.append(c)
                continue
            k = next(k for k in range(len(blocks)) if leaves <= set(blocks[k]) | self.before(blocks[:k + 1]))
            block_conds[max(k, floor)].append(self.cond(c, leaves))
        placed = {id(c.node) for cs in block_conds for c in cs}
        # an outer join's ON is read until that join is built: a pending condition, not a final need
        barrier_on = [_Cond(j.args["on"], frozenset()) for j in barriers if j.args.get("on") is not None]
        self.final = _Needs()
        self.final.add(self.node, placed | {id(n) for n in self.leaf_nodes} | {id(c.node) for c in barrier_on},
                       self.node)
        for j in self.joins:
            for u in j.args.get("using") or []:
                self.final.names.add(ident(u))
        self.pending = [c for cs in block_conds for c in cs] + barrier_on
        carried: _Input | None = None
        for k, block in enumerate(blocks):
            inputs = [_Input(self.leaves[i], frozenset([i]), _label(self.leaves[i], self.leaf_nodes[i]), i)
                      for i in block]
            if carried is not None:
                inputs[0] = carried
            rel = self.block(inputs, block_conds[k])
            if k < len(barriers):
                carried = self.written(barriers[k], rel, blocks[:k + 1], blocks[k + 1][0], barrier_on)
        if self.notes:
            head = "join plan (FROM " + ", ".join(
                _label(r, n) for r, n in zip(self.leaves, self.leaf_nodes)) + "):"
            note = "\n".join([head] + ["  " + n for n in self.notes])
            if self.b.notes is not None and note not in self.b.notes:
                self.b.notes.append(note)
        return rel, rest

    def written(self, j: exp.Join, rel: Rel, done: list[list[int]], right_leaf: int, barrier_on: list[_Cond]
                ) -> _Input:
        """The outer (or USING) join ``j`` of the blocks ``done`` (planned as ``rel``) with its right leaf, in the
        written order. Of a LEFT join's ON, the conjuncts that read only the right side filter it first (and of a
        RIGHT join's, those that read only the left side): a row they drop is one with no partner, padded alike."""
        label = _label(self.leaves[right_leaf], self.leaf_nodes[right_leaf])
        left, kept_l = self.prune(rel)
        right, kept_r = self.prune(self.leaves[right_leaf])
        for c in barrier_on:
            c.done = c.done or c.node is j.args.get("on")
        side = (j.args.get("side") or "").upper() or "INNER"
        on = j.args.get("on")
        how = f" ON {_sql(on)}" if on is not None else (
            " USING (" + ", ".join(ident(u) for u in j.args["using"]) + ")" if j.args.get("using") else "")
        filtered = ""
        if side in ("LEFT", "RIGHT") and on is not None:
            inner_side = {right_leaf} if side == "LEFT" else {i for blk in done for i in blk}
            push, keep = [], []
            for c in conjuncts(on):
                leaves = self.leaves_of(c)
                (push if leaves and leaves <= inner_side else keep).append(c)
            if push:
                if side == "LEFT":
                    right = self.b.filter(right, push)
                else:
                    left = self.b.filter(left, push)
                j = j.copy()
                j.set("on", exp.and_(*keep) if keep else None)
                filtered = f"\n    {label if side == 'LEFT' else 'left'} filtered first by " + \
                    " AND ".join(_sql(c) for c in push)
        joined, _ = self.b.join(left, j, [], right)
        self.notes.append(f"{side} JOIN {label}{how} (in the written order)" + filtered
                          + self.kept(kept_l, kept_r, label))
        covered = frozenset(i for blk in done for i in blk) | {right_leaf}
        return _Input(joined, covered, "(" + ", ".join(sorted(joined.tables())) + ")", 0)

    @staticmethod
    def before(blocks: list[list[int]]) -> set[int]:
        return {i for blk in blocks[:-1] for i in blk}

    # ---- one block of inner joins ----

    def block(self, inputs: list[_Input], conds: list[_Cond]) -> Rel:
        """Invariant 4 over the inputs of one block."""
        b = self.b
        for inp in inputs:
            mine = [c for c in conds if c.leaves <= inp.leaves]
            if mine:
                inp.rel = b.filter(inp.rel, [c.node for c in mine])
                for c in mine:
                    c.done = True
                    inp.est *= _selectivity(c.node)
                inp.notes.append("filter " + " AND ".join(_sql(c.node) for c in mine))
        if len(inputs) == 1:
            if inputs[0].notes:
                self.start(inputs[0])
            return self.apply(inputs[0], conds).rel
        left = sorted(inputs, key=lambda i: (i.est, i.pos))
        comps: list[_Input] = []
        while left:
            comp = left.pop(0)
            comp = self.start(comp)
            while True:
                cands = [(i, self.keys(comp, i, conds)) for i in left]
                cands = [(i, k) for i, k in cands if k]
                if not cands:
                    break
                nxt, keys = min(cands, key=lambda ik: (ik[0].est, -len(ik[1]), ik[0].pos))
                left.remove(nxt)
                comp = self.join(comp, nxt, keys, conds)
            comps.append(comp)
        comps.sort(key=lambda i: (i.est, i.pos))
        out = comps.pop(0)
        while comps:
            linked = [c for c in comps if any(not x.done and x.leaves <= out.leaves | c.leaves
                                              and not x.leaves <= out.leaves and not x.leaves <= c.leaves
                                              for x in conds)]
            nxt = (linked or comps)[0]
            comps.remove(nxt)
            out = self.join(out, nxt, self.keys(out, nxt, conds), conds)
        # the columns in FROM order, as SELECT * lists them, whatever order the joins took
        order = sorted(range(len(out.rel.cols)), key=lambda i: out.origin[i])
        return Rel(out.rel.stream, [out.rel.cols[i] for i in order])

    def start(self, inp: _Input) -> _Input:
        self.notes.append(f"{inp.label}" + "".join(f"  {n}" for n in inp.notes))
        return inp

    @staticmethod
    def keys(a: _Input, b: _Input, conds: list[_Cond]) -> list[tuple[_Cond, exp.Expression, exp.Expression]]:
        """The unused equalities with one side in ``a`` and the other in ``b``, as (cond, a's side, b's side)."""
        out = []
        for c in conds:
            if c.done or c.sides is None:
                continue
            x, y = c.sides
            if x <= a.leaves and y <= b.leaves:
                out.append((c, c.node.this, c.node.expression))
            elif y <= a.leaves and x <= b.leaves:
                out.append((c, c.node.expression, c.node.this))
        return out

    def join(self, a: _Input, b: _Input, keys: list, conds: list[_Cond]) -> _Input:
        both = a.leaves | b.leaves
        used = {id(c) for c, _, _ in keys}
        residual = [c for c in conds if not c.done and c.leaves <= both and id(c) not in used]
        left, kept_l = self.prune(a.rel)  # before the conditions of this join count as applied: it reads them
        right, kept_r = self.prune(b.rel)
        origin = ([o for c, o in zip(a.rel.cols, a.origin) if c in left.cols]
                  + [o for c, o in zip(b.rel.cols, b.origin) if c in right.cols])
        for c in [c for c, _, _ in keys] + residual:
            c.done = True
        rel = self.b.inner(left, right, [(x, y) for _, x, y in keys], [c.node for c in residual])
        step = f"JOIN {b.label}" + "".join(f"  {n}" for n in b.notes)
        step += ("  ON " + " AND ".join(f"{_sql(x)} = {_sql(y)}" for _, x, y in keys)) if keys else \
            "  CROSS (no condition connects them)"
        if residual:
            step += "  then filter " + " AND ".join(_sql(c.node) for c in residual)
        self.notes.append(step + self.kept(kept_l, kept_r, b.label))
        est = max(a.est, b.est) if keys else a.est * b.est
        for c in residual:
            est *= _selectivity(c.node)
        assert len(origin) == len(rel.cols)
        return _Input(rel, both, f"({a.label} x {b.label})", min(a.pos, b.pos), est, origin=origin)

    def apply(self, inp: _Input, conds: list[_Cond]) -> _Input:
        todo = [c for c in conds if not c.done]
        for c in todo:
            c.done = True
        if todo:
            inp.rel = self.b.filter(inp.rel, [c.node for c in todo])
        return inp

    # ---- column pruning (invariant 5) ----

    @staticmethod
    def kept(left: str, right: str, label: str) -> str:
        parts = ([f"left keeps {left}"] if left else []) + ([f"{label} keeps {right}"] if right else [])
        return ("\n    " + "; ".join(parts)) if parts else ""

    def prune(self, rel: Rel) -> tuple[Rel, str]:
        """``rel`` narrowed to the fields read after this point, and what it kept ("" when it keeps all)."""
        needs = self.final
        for c in self.pending:
            if not c.done:
                extra = _Needs()
                extra.add(c.node, set())
                needs = needs.union(extra)
        keep = [c for c in rel.cols if needs.keeps(c.table, c.name)]
        fields = list(dict.fromkeys(c.field for c in keep))
        if not fields:  # nothing is read (COUNT(*)): one field still carries the rows
            fields = [rel.cols[0].field] if rel.cols else [rel.schema.names[0]]
        if len(fields) == len(rel.schema.names):
            return rel, ""
        kept = set(fields)
        out = Rel(self.b.narrow(rel, fields), [c for c in rel.cols if c.field in kept])
        names = ", ".join(dict.fromkeys(c.name for c in out.cols)) or fields[0]
        return out, f"({names}) of {len(rel.schema.names)} fields"


def _comma(j: exp.Join) -> bool:
    """Whether ``j`` is a comma of the FROM list (sqlglot gives a comma's Join no argument but the table)."""
    return set(j.args) == {"this"}


def _item_name(item: exp.Expression) -> str | None:
    """The name a FROM item is known by: its alias, else a table's name."""
    alias = item.args.get("alias")
    if alias is not None and alias.this is not None:
        return tname(alias.this) if isinstance(alias.this, exp.Identifier) else None
    return tname(item.this) if isinstance(item, exp.Table) and isinstance(item.this, exp.Identifier) else None


def _group_after_commas(b: Builder, node: exp.Select) -> None:
    """The comma binds loosest in FROM: ``FROM a, b FULL JOIN c ON ...`` is ``a x (b FULL JOIN c ON ...)``. A run
    of joins after a comma that holds a RIGHT or FULL JOIN is regrouped in place as that parenthesised item (the
    planner would join it to everything before; for inner and LEFT joins both readings agree). Its ON may not name
    an item before the comma: DuckDB then joins the run once per row of that item (a lateral join), refused."""
    joins = list(node.args.get("joins") or [])
    out: list[exp.Join] = []
    i = 0
    while i < len(joins):
        j = joins[i]
        run = []
        k = i + 1
        while _comma(j) and k < len(joins) and not _comma(joins[k]):
            run.append(joins[k])
            k += 1
        outer = [x for x in run if (x.args.get("side") or "").upper() in ("RIGHT", "FULL")]
        if not outer:
            out += joins[i:k]
            i = k
            continue
        item = j.this
        side = outer[0].args["side"].upper()
        if item.args.get("joins"):
            raise b.src.error(outer[0], f"{side} JOIN after a comma and a parenthesised join is not supported; "
                                        f"put the whole item in parentheses, FROM a, ((b JOIN c ...) {side} JOIN d ...)")
        names = {_item_name(item)} | {_item_name(x.this) for x in run}
        for x in run:
            for col in (x.args.get("on") or exp.Boolean(this=True)).find_all(exp.Column):
                q = col.args.get("table")
                if q is not None and isinstance(q, exp.Identifier) and tname(q) not in names:
                    raise b.src.error(col, f"the ON of a JOIN after a comma names {tname(q)!r}, which stands before "
                                           f"the comma: DuckDB joins that part once per row of {tname(q)!r} (a "
                                           f"lateral join), which is not supported with a RIGHT or FULL JOIN")
        grouped = item.copy()
        grouped.set("joins", [x.copy() for x in run])
        out.append(exp.Join(this=exp.Subquery(this=grouped)))
        i = k
    if len(out) != len(joins):
        node.set("joins", out)


def plan_from(b: Builder, node: exp.Select, where: list[exp.Expression]) -> tuple[Rel, list[exp.Expression]]:
    """The FROM clause of ``node`` with its joins, and the WHERE conjuncts not placed in it (invariants 1-6)."""
    _group_after_commas(b, node)
    fp = _FromPlan(b, node, where)
    got = fp.plan()
    if got is not None:
        return got
    rel = fp.leaves[0]  # invariant 3: the written order, each join's conditions at it
    for j, right in zip(fp.joins, fp.leaves[1:]):
        rel, where = b.join(rel, j, where, right)
    return rel, where
