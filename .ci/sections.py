"""Deletes each removable section of custom_partitioning.py, with its seam
lines, and checks that the copy left still works.

  python .ci/sections.py [--list] [--write SECTION DIR] [--check [SECTION...]]
  python .ci/sections.py --text   # the checks on text and names alone, fast

SECTION ``core`` names the minimal copy: every removable section deleted at
once (``--write core DIR`` writes it; ``--check`` runs it last, skipping the
union of the removed sections' tests).

A removable section is each of Part II, and III.2 and III.4 (the tools);
it is entered only from lines marked ``# seam: ... (<section>)``. Deleting
it, mechanically, means:
- its lines go, from its banner to the next banner;
- a seam line that opens an ``if`` or ``elif`` loses that branch: the rest of
  the chain stays, and an ``else`` body left alone takes the ``if``'s place
  (the branch is gone, the plain path runs);
- any other statement marked as a seam goes whole, with its decorators and
  the comment lines just above it; a definition only extras use names each
  (``# seam: used by (II.1, II.4)``) and goes with the last of them;
- text about it goes: a comment or docstring line ending in its number in
  brackets (``(II.4)``, ``(Part II)`` for every extra; then ``.``, ``;``,
  ``,`` or ``:`` may follow), with the lines of its sentence before it (back
  to a blank line or one ending in ``.``, ``:`` or such a bracket: a
  sentence runs on across ``;``);
  a seam naming several sections no longer names it; and, in the minimal
  copy, Part II's banner;
- imports only removed sections used go.
``--check`` writes each copy (with the test file beside it) to a temporary
directory, and fails unless ruff finds no undefined name or unused import
in it; it looks up only the jax names it reads (its ``*_NAMES`` tables,
an attribute of a looked-up module read only where listed under it:
``names_unused``) and holds no top-level definition nothing reads
(``unreferenced``; in the minimal copy, no class nothing builds); its
comments and docstrings name no section it lacks (``stale_text``), no
private name it lacks, and in the minimal copy no feature or flag of a
removed section (``untrue_text``, ``CLAIMS``); the minimal copy imports and
runs an op with XLA's Python-partitioner API withdrawn from jax
(``WITHDRAWN_API``); and the core set passes (both partitioners: a run
with JAX_USE_SHARDY_PARTITIONER=1, then one of the GSPMD variants with 0),
the removed section's tests skipped by the names in SKIPS below (run by
``--run``).
"""
import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODULE = os.path.join(ROOT, "custom_partitioning.py")
TESTS = os.path.join(ROOT, "test_custom_partitioning.py")

REMOVABLE = r"II\.\d+|III\.[24]"
BANNER = "# " + "-" * 74
# A seam names one section, or (a definition only extras use) several:
# ``(II.2, II.4)`` goes with the last of them.
SEAM = re.compile(r"#.*\bseam:.*\(((?:" + REMOVABLE + r")(?:, (?:" +
                  REMOVABLE + r"))*)\)")

# The core set (.ci/matrix's), and per section the tests of what it adds,
# skipped in a copy without it (a test id containing one of the strings).
CORE = ["ElementwiseTest", "FrontendTest", "ShardyRuleTest", "RuleToMlirTest",
        "FFTTest", "CallbackContractTest", "GspmdEraOpsTest", "AtLoweringTest",
        "TransformTest", "TrimmedCopyTest",
        "HijaxTest", "ImportTest", "test_shard_map_all_axes_manual",
        "test_cholesky_batch_sharded_has_no_collective",
        "test_readme_quickstart_runs", "test_shape_polymorphism",
        "test_ordered_io_callback_is_refused_by_name",
        "test_ops_after_an_empty_one_keep_their_own_placements"]
SKIPS: dict[str, list[str]] = {
    # An infer error, raised where XLA asked (II.2 keeps it for partition),
    # and a partly manual shard_map's placement.
    "II.2": ["test_no_rule_derivable_warns_once_and_runs",
             "test_manual_axes_are_not_probed",
             "test_partly_manual_shard_map_for_tpu_is_named"],
    "II.3": ["test_explicit_axes"],  # the shard_map path
    "II.4": ["TransformTest", "test_grad", "test_vjp", "test_vmap",
             "test_derived_ops"],
    "II.5": ["RuleOnlyTest", "test_readme_quickstart_runs",  # cholesky
             "test_several_ops_results_statics_and_loops",
             "test_gspmd_era_op_and_rule_only_op_on_a_2d_mesh"],
    # The derived rule, under Shardy.
    "II.6": ["GspmdEraOpsTestShardy",
             "test_gspmd_era_op_and_rule_only_op_on_a_2d_mesh"],
    # XLA's callbacks: GSPMD, and every fallback (callback_path()).
    # (Tests that ask for them, callback_path(), skip themselves.)
    "II.7": ["GSPMD", "test_the_switch_is_read_from_the_environment",
             "test_the_switch_keeps_xla_callbacks_off_tpu",
             "test_an_answer_without_a_partition_spec_keeps_the_callbacks",
             "test_a_mesh_of_logical_device_ids_is_read_with_them",
             "test_manual_axes_are_not_probed",
             "test_no_gather_or_all_to_all_that_gspmd_lacks"],
    # The quickstart's log, and the derived rule as the log shows it.
    "II.8": ["test_readme_quickstart_runs", "test_the_log_names_the_path",
             "test_values_placement_and_derived_rule_on_auto_axes",
             "test_what_no_factor_states_is_named",
             "test_an_axis_infer_always_places_is_not_probed_with",
             "test_an_infer_raising_on_a_probe_is_named_and_not_fatal",
             "test_more_factors_than_letters",
             "test_probes_raised_on_are_counted_and_the_first_named",
             "test_static_arguments_key_the_derivation",
             "test_two_operands_tied_through_two_results",
             "test_two_operand_dimensions_onto_one_result_dimension",
             "test_a_probed_axis_inside_a_tuple_entry_ties",
             "test_decode_shardings_keys_the_derivation"],
    # An op placed apart asked once per place.
    "II.9": ["test_each_place_of_a_shared_lowering_is_asked_apart",
             "test_equal_ops_over_other_sub_axes_are_asked_apart",
             "test_equal_ops_placed_by_their_results_are_asked_apart",
             "test_ops_after_a_shared_lowering_lowered_again_keep_their_own",
             "test_placements_are_read_through_loops_calls_and_shard_maps",
             "test_shared_lowerings_inside_shared_lowerings"],
    "III.2": ["check_partitioning", "test_readme_quickstart_runs"],
    "III.4": ["FFTTest"],  # the demo's FFT op
}


def sections(lines: list[str]) -> dict[str, tuple[int, int]]:
  """Section number -> (first line, line after its last), 0-based."""
  starts = []
  for i, line in enumerate(lines[:-1]):
    if line == BANNER and lines[i - 1] != "#" and (
        m := re.match(r"# ((?:I|II|III)\.\d+) ", lines[i + 1])):
      starts.append((m.group(1), i))
  # A section ends where the next banner (of any kind) begins.
  ends = [i for i, line in enumerate(lines)
          if line in (BANNER, "# " + "=" * 74) and
          not (i and lines[i - 1].startswith("# ") and lines[i - 1] != "#"
               and lines[i - 1] not in (BANNER,))]
  out = {}
  for name, start in starts:
    end = min((e for e in ends if e > start + 2), default=len(lines))
    out[name] = (start, end)
  return out


def removable(lines) -> list[str]:
  return [s for s in sections(lines) if re.fullmatch(REMOVABLE, s)]


def _stmt_at(tree, lineno: int):
  """The statement (and its parent's list) whose first line is ``lineno``."""
  for node in ast.walk(tree):
    for field in ("body", "orelse", "finalbody", "handlers"):
      block = getattr(node, field, None)
      if not isinstance(block, list):
        continue
      for stmt in block:
        if isinstance(stmt, ast.stmt) and stmt.lineno == lineno:
          return stmt, node, field
  raise ValueError(f"no statement starts at line {lineno}")


def _drop_seam(lines: list[str], lineno: int) -> list[str]:
  """``lines`` without the seam statement at ``lineno`` (1-based)."""
  tree = ast.parse("\n".join(lines))
  stmt, parent, field = _stmt_at(tree, lineno)
  i = lineno - 1
  if not isinstance(stmt, ast.If):
    # Its decorators, and the comment lines just above (its own), go too.
    i = min([i] + [d.lineno - 1 for d in getattr(stmt, "decorator_list", ())])
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    while i and lines[i - 1].startswith(indent + "#") and (
        lines[i - 1] not in (BANNER, "# " + "=" * 74)):
      i -= 1
    del lines[i:stmt.end_lineno]
    return _pad(lines, i)
  text = lines[i].lstrip()
  is_elif = text.startswith("elif ")
  orelse = stmt.orelse
  if orelse and isinstance(orelse[0], ast.If) and lines[
      orelse[0].lineno - 1].lstrip().startswith("elif "):
    j = orelse[0].lineno - 1  # the next elif takes this branch's place
    if not is_elif:
      lines[j] = lines[j].replace("elif ", "if ", 1)
    del lines[i:j]
    return lines
  if orelse:
    # The else line: the last line before the else body starting with else.
    k = orelse[0].lineno - 1
    while not lines[k].lstrip().startswith("else"):
      k -= 1
    if is_elif:  # the chain's else stays
      del lines[i:k]
      return lines
    indent = len(lines[i]) - len(text)
    body = [_dedent(line, len(lines[k + 1]) - len(lines[k + 1].lstrip())
                    - indent) for line in lines[k + 1:stmt.end_lineno]]
    lines[i:stmt.end_lineno] = body
    return lines
  del lines[i:stmt.end_lineno]
  return _pad(lines, i)


def _dedent(line: str, n: int) -> str:
  return line[n:] if line[:n].strip() == "" else line


def _pad(lines: list[str], i: int) -> list[str]:
  """A ``pass`` where deleting left a block empty."""
  try:
    ast.parse("\n".join(lines))
  except SyntaxError:
    prev = lines[i - 1]
    indent = len(prev) - len(prev.lstrip()) + 2
    lines.insert(i, " " * indent + "pass")
  return lines


def without(section: str, text: str, gone: frozenset = frozenset()) -> str:
  """``text`` (the module) without ``section``, its seam lines and its text
  (where the sections ``gone`` are already deleted: a seam naming several
  goes with the last)."""
  lines = text.split("\n")
  start, end = sections(lines)[section]
  del lines[start:end]
  gone = gone | {section}
  while True:
    seams = [i + 1 for i, line in enumerate(lines)
             if (m := SEAM.search(line)) and section in (
                 named := set(m.group(1).split(", "))) and named <= gone]
    if not seams:
      break
    lines = _drop_seam(lines, seams[-1])
  for i, line in enumerate(lines):  # the others' seams stop naming it
    if (m := SEAM.search(line)) and section in m.group(1).split(", "):
      rest = ", ".join(n for n in m.group(1).split(", ") if n != section)
      lines[i] = line[:m.start(1)] + rest + line[m.end(1):]
  parts = {"II"} if not any(re.fullmatch(r"II\.\d+", s)
                            for s in sections(lines)) else set()
  return "\n".join(_trim_text(lines, gone | parts))


# Text about a section: a comment or docstring line ending in its number in
# brackets, and a line ending a sentence (or in any section's bracket).
MARK = re.compile(r"\((?:Part )?(" + REMOVABLE + r"|II)\)[.;,:]?$")
ENDS = re.compile(r"([.:]|\((?:Part )?(?:I|II|III)(?:\.\d+)?\)[.;,:]?)$")


def _trim_text(lines: list[str], gone: set) -> list[str]:
  """``lines`` without the text about the sections ``gone`` (see above)."""
  doc: set = set()  # the 0-based lines of docstrings
  for node in ast.walk(ast.parse("\n".join(lines))):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr) and
        isinstance(body[0].value, ast.Constant) and
        isinstance(body[0].value.value, str)):
      doc.update(range(body[0].lineno, body[0].end_lineno - 1))  # inner
  keep = [True] * len(lines)
  for i, line in enumerate(lines):
    comment = line.lstrip().startswith("#")
    text = line.strip().lstrip("#").strip()
    m = MARK.search(text)
    if not m or m.group(1) not in gone or not (comment or i in doc):
      continue
    j = i
    while j > 0:
      prev = lines[j - 1].strip()
      if comment != prev.startswith("#") or not comment and j - 1 not in doc:
        break
      prev = prev.lstrip("#").strip()
      if not prev or ENDS.search(prev) or set(prev) == {"-"}:
        break
      j -= 1
    keep[j:i + 1] = [False] * (i + 1 - j)
    if 0 < j and i + 1 < len(lines) and (  # no blank line left doubled
        lines[j - 1].strip().lstrip("#") == "" and
        lines[i + 1].strip().lstrip("#") == "" and (comment or i + 1 in doc)):
      keep[i + 1] = False
  return [line for line, k in zip(lines, keep) if k]


def core(text: str) -> str:
  """``text`` (the module) without every removable section: the minimal
  copy."""
  gone: frozenset = frozenset()
  for section in reversed(removable(text.split("\n"))):
    text = without(section, text, gone)
    gone |= {section}
  lines = text.split("\n")
  # Part II's banner, with no section left under it, goes.
  part = next((i for i, line in enumerate(lines)
               if line.startswith("# Part II.")), None)
  if part is not None:
    end = next(i for i in range(part + 1, len(lines))
               if lines[i] == "# " + "=" * 74)
    after = next(i for i in range(end + 1, len(lines)) if lines[i].strip())
    if lines[after + 1].startswith("# Part III."):
      del lines[part - 1:after]
  return re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines))


def _imports_used(text: str) -> str:
  """``text`` without the imports only removed sections used (ruff's F401
  in a copy)."""
  lines = text.split("\n")
  for i in reversed(range(len(lines))):
    m = re.fullmatch(r"import (\w+)", lines[i])
    if m and not re.search(rf"\b{m.group(1)}\b", "\n".join(
        lines[:i] + lines[i + 1:])):
      del lines[i]
  return "\n".join(lines)


def _tables(tree) -> dict:
  """Name -> the jax module it is looked up in, for every name of the
  copy's tables of jax's names (``*_NAMES``, each release's branch)."""
  return {name: module for module, name in _entries(tree)}


def _entries(tree) -> set:
  """``(module, name)`` for every name of the copy's tables."""
  listed = set()
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id.endswith("_NAMES")
        for t in node.targets):
      for table in ast.walk(node.value):
        if isinstance(table, ast.Dict):
          for key, value in zip(table.keys, table.values):
            if isinstance(key, ast.Constant):
              listed.update((key.value, name.rstrip("?"))
                            for c in ast.walk(value)
                            if isinstance(c, ast.Constant) and
                            isinstance(c.value, str)
                            for name in c.value.split())
  return listed


def names_unused(text: str) -> list[str]:
  """The names the copy's tables look up that it never reads (as
  ``_jax.<name>``, the string ``"<name>"``, or an attribute of a looked-up
  module: ``_jax.mlir.<name>`` reads ``<name>`` only where the table lists
  it under that module), and those it reads that no table lists."""
  tree = ast.parse(text)
  listed = _tables(tree)
  entries = _entries(tree)
  tables = {id(n) for node in tree.body if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id.endswith("_NAMES")
                    for t in node.targets) for n in ast.walk(node)}
  read, strings = set(), set()
  for node in ast.walk(tree):
    if id(node) in tables:
      continue
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      strings.add(node.value)
    if not isinstance(node, ast.Attribute):
      continue
    if isinstance(node.value, ast.Name) and node.value.id == "_jax":
      read.add(node.attr)
    elif (isinstance(node.value, ast.Attribute) and
          isinstance(node.value.value, ast.Name) and
          node.value.value.id == "_jax" and node.value.attr in listed and
          (f"{listed[node.value.attr]}.{node.value.attr}", node.attr)
          in entries):
      read.add(node.attr)
  first = {node.attr for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and
           isinstance(node.value, ast.Name) and node.value.id == "_jax"}
  return ([f"{listed[n]}.{n} looked up, never read" for n in sorted(listed)
           if n not in read and n not in strings] +
          [f"_jax.{n} read, in no table" for n in sorted(first - set(listed))])


def unreferenced(text: str, tests: str, built: bool = False) -> list[str]:
  """The copy's private top-level definitions nothing reads (the tests'
  ``cp.<name>`` aside), and with ``built`` (the minimal copy: in another,
  an extra may ask about a sibling's objects) its private classes nothing
  builds."""
  tree = ast.parse(text)
  defined = []
  for node in tree.body:
    for sub in [node] + (list(ast.walk(node)) if isinstance(node, ast.If)
                         else []):
      if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
        defined.append((sub.name, sub.lineno))
      targets = (sub.targets if isinstance(sub, ast.Assign) else
                 [sub.target] if isinstance(sub, ast.AnnAssign) else [])
      defined += [(t.id, sub.lineno) for t in targets
                  if isinstance(t, ast.Name)]
  read = {node.id for node in ast.walk(tree)
          if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
  read |= {node.value for node in ast.walk(tree)  # globals().get("_x")
           if isinstance(node, ast.Constant) and isinstance(node.value, str)}
  read |= set(re.findall(r"\bcp\.(_\w+)", tests))
  # A class nothing builds (no call, no subclass) is dead too, however
  # often isinstance asks for it.
  made = {node.func.id for node in ast.walk(tree) if isinstance(
      node, ast.Call) and isinstance(node.func, ast.Name)}
  made |= {b.id for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
           for b in node.bases if isinstance(b, ast.Name)}
  classes = {node.name for node in tree.body
             if built and isinstance(node, ast.ClassDef)}
  return [f"line {line}: {name}" + (" (never built)" if name in read else "")
          for name, line in defined
          if name.startswith("_") and not name.startswith("__")
          and (name not in read or name in classes and name not in made)]


def stale_text(text: str, gone: set) -> list[str]:
  """Lines of the copy that name a section it lacks (of ``gone``)."""
  lines = text.split("\n")
  return [f"line {i}: {line.strip()}" for i, line in enumerate(lines, 1)
          for s in gone if re.search(rf"\b{re.escape(s)}\b(?![\d.]*\d)",
                                     line)]


# What the minimal copy must not say it does: phrases naming each removed
# section's features and flags, read in comments and docstrings (an error
# message may name what the copy lacks, as the fix). Only there: in a copy
# without one section, its siblings may name what they do with it.
CLAIMS = {
    "II.3": [r"shard_map path", r"_explicit_call"],
    "II.4": [r"\bvmap\b", r"\bjvp\b", r"\bgrad\b", r"\btranspos",
             r"derived op"],
    "II.5": [r"rule alone", r"rule-only", r"derived from the rule"],
    "II.6": [r"\bprobed?\b", r"derived rule", r"rule derived"],
    "II.7": [r"(?<!without )XLA's callbacks", r"persistent", r"GSPMD only",
             r"[Uu]nder GSPMD\b", r"AT_LOWERING=", r"content key"],
    "II.8": [r"\bDEBUG\b", r"\blogged\b"],
    "III.2": [r"check_partitioning"],
    "III.4": [r"\bdemo\b", r"python custom_partitioning\.py"],
}


def _prose(text: str) -> list[tuple[int, str]]:
  """``(line number, text)`` of every comment and docstring line."""
  lines = text.split("\n")
  doc: set = set()
  for node in ast.walk(ast.parse(text)):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr) and
        isinstance(body[0].value, ast.Constant) and
        isinstance(body[0].value.value, str)):
      doc.update(range(body[0].lineno, body[0].end_lineno + 1))
  out = []
  for i, line in enumerate(lines, 1):
    if i in doc:
      out.append((i, line.strip()))
    elif "#" in line:
      code = line.split("#", 1)[0]
      if code.count('"') % 2 == 0 and code.count("'") % 2 == 0:
        out.append((i, line.split("#", 1)[1].strip()))
  return out


# Upstream's private names, which the module's docstring maps to its own.
UPSTREAM = {"_resolve_kwargs", "_custom_partitioning_lowering_rule",
            "_ShardingCallbackInfo",
            "_sharding_callbacks", "_custom_partitioning_partition",
            "_custom_partitioning_infer_sharding_from_operands",
            "_custom_partitioning_propagate_user_sharding"}


PRIVATE = re.compile(r"(?<![\w.])(_[A-Za-z]\w*[A-Za-z\d])(?![\w<])")


def untrue_text(text: str, gone: set, claims: bool) -> list[str]:
  """Comment and docstring lines of the copy that name a private name
  (````_x```` or ``_x``) it does not define, or (``claims``) a feature or
  flag of a section it lacks (``CLAIMS``)."""
  tree = ast.parse(text)
  known = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  known |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  known |= {n.name for n in ast.walk(tree) if isinstance(
      n, (ast.FunctionDef, ast.ClassDef))}
  known |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
            for a in n.args + n.kwonlyargs + n.posonlyargs}
  found = []
  for i, line in _prose(text):
    said = [p for s in gone for p in CLAIMS.get(s, ()) if claims and
            re.search(p, line)]
    names = [n for n in PRIVATE.findall(line)
             if n not in known and n not in UPSTREAM]
    if said or names:
      found.append(f"line {i}: {line} ({', '.join(said + names)})")
  return found


# XLA's Python-partitioner API, which the minimal copy (Shardy's path
# alone) must not need: deleted from jax before it is imported.
WITHDRAWN_API = [
    ("jax._src.lib.xla_client", "register_custom_call_partitioner"),
    ("jax._src.xla_bridge", "register_plugin_callbacks"),
    ("jax._src.compiler", "register_xla_runtime_error_handler"),
]
RUN_WITHDRAWN = """
import importlib, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
for where, name in {withdrawn!r}:
  parts = where.split(".")
  module = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], 2):  # (xla_client: an attribute)
    if not hasattr(module, part):
      importlib.import_module(".".join(parts[:i]))
    module = getattr(module, part)
  if hasattr(module, name):
    delattr(module, name)
sys.path.insert(0, os.getcwd())
try:  # Shardy, the copy's partitioner (GSPMD is the default before 0.7)
  jax.config.update("jax_use_shardy_partitioner", True)
except AttributeError:  # a release that dropped the flag
  pass
import custom_partitioning as cp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
op = cp.custom_partitioning(lambda x: x * 2.0)
op.def_partition(lambda m, a, r: (m, lambda v: v * 2.0, a[0].sharding,
                                  (a[0].sharding,)),
                 sharding_rule="i j -> i j")
mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P("x")))
np.testing.assert_allclose(jax.jit(op)(x), 2.0)
print("ran without", len({withdrawn!r}), "names of XLA's partitioner API")
"""


def copy_of(name: str, text: str) -> str:
  return _imports_used(core(text) if name == "core" else without(name, text))


def skips_of(name: str) -> list[str]:
  return ([s for skips in SKIPS.values() for s in skips] if name == "core"
          else SKIPS.get(name, []))


def run_tests(skips: list[str], only: str | None = None) -> int:
  """The core set, without tests whose id contains one of ``skips`` (and
  with ``only``, those whose id contains it)."""
  import unittest
  sys.path.insert(0, os.getcwd())
  loader = unittest.defaultTestLoader
  suite = loader.loadTestsFromName("test_custom_partitioning")

  def keep(test):
    tid = test.id()
    return (any(c in tid for c in CORE) and
            not any(s in tid for s in skips) and (only or "") in tid)

  def flat(s):
    for t in s:
      yield from (flat(t) if isinstance(t, unittest.TestSuite) else [t])
  chosen = unittest.TestSuite([t for t in flat(suite) if keep(t)])
  result = unittest.TextTestRunner(verbosity=1).run(chosen)
  for test, _ in result.failures + result.errors:
    print("failed:", test.id())
  return 0 if result.wasSuccessful() else 1


def check(names: list[str]) -> int:
  text = open(MODULE).read()
  status = 0
  for name in names:
    with tempfile.TemporaryDirectory() as d:
      with open(os.path.join(d, "custom_partitioning.py"), "w") as f:
        f.write(copy_of(name, text))
      for path in (TESTS, os.path.join(ROOT, "README.md")):
        with open(path) as src, open(
            os.path.join(d, os.path.basename(path)), "w") as f:
          f.write(src.read())
      ruff = subprocess.run(
          ["ruff", "check", "--isolated", "--select", "F401,F821,F822",
           "custom_partitioning.py"], cwd=d, capture_output=True, text=True)
      if ruff.returncode:
        print(f"without {name}: undefined names\n{ruff.stdout}")
        status = 1
        continue
      copy = copy_of(name, text)
      gone = set(removable(text.split("\n")) if name == "core" else [name])
      for what, found in (
          ("jax names", names_unused(copy)),
          ("unreferenced definitions", unreferenced(
              copy, open(TESTS).read(), built=name == "core")),
          ("text naming a section it lacks", stale_text(copy, gone)),
          ("text naming what it lacks", untrue_text(
              copy, gone, claims=name == "core"))):
        if found:
          print(f"without {name}: {what}:\n  " + "\n  ".join(found))
          status = 1
      if name == "core":
        run = subprocess.run(
            [sys.executable, "-c",
             RUN_WITHDRAWN.format(withdrawn=WITHDRAWN_API)],
            cwd=d, capture_output=True, text=True)
        print(f"without {name}: " + (run.stdout.strip() if not run.returncode
                                     else "fails with XLA's partitioner API "
                                     "withdrawn\n" + run.stderr[-3000:]))
        status |= run.returncode != 0
      # Both partitioners: a run takes one's variants (the tests' default:
      # jax's), so Shardy's with the rest, then GSPMD's variants alone.
      for shardy, only in (("1", []), ("0", ["--only", "GSPMD."])):
        env = dict(os.environ, JAX_USE_SHARDY_PARTITIONER=shardy)
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--run", name, *only],
            cwd=d, capture_output=True, text=True, env=env)
        tail = run.stderr.strip().splitlines()[-1:] or ["?"]
        print(f"without {name}, JAX_USE_SHARDY_PARTITIONER={shardy}: "
              f"{tail[0]}", flush=True)
        if run.returncode:
          print(run.stdout + run.stderr[-3000:])
          status = 1
  return status


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--write", nargs=2, metavar=("SECTION", "DIR"))
  parser.add_argument("--check", nargs="*")
  parser.add_argument("--run", metavar="SECTION")
  parser.add_argument("--only", metavar="TEXT")
  parser.add_argument("--text", action="store_true",
                      help="every copy's checks but ruff and the tests")
  a = parser.parse_args()
  text = open(MODULE).read()
  if a.text:
    status = 0
    for name in removable(text.split("\n")) + ["core"]:
      copy = copy_of(name, text)
      gone = set(removable(text.split("\n")) if name == "core" else [name])
      found = (stale_text(copy, gone) +
               untrue_text(copy, gone, claims=name == "core") +
               unreferenced(copy, open(TESTS).read(), built=name == "core") +
               names_unused(copy))
      print(f"without {name}: {len(found)}" + "".join(
          f"\n  {line}" for line in found))
      status |= bool(found)
    return status
  if a.list:
    for name, (s, e) in sections(text.split("\n")).items():
      print(name, s + 1, e, "removable" if re.fullmatch(REMOVABLE, name)
            else "")
    return 0
  if a.write:
    os.makedirs(a.write[1], exist_ok=True)
    with open(os.path.join(a.write[1], "custom_partitioning.py"), "w") as f:
      f.write(copy_of(a.write[0], text))
    return 0
  if a.run:
    return run_tests(skips_of(a.run), a.only)
  return check(a.check or removable(text.split("\n")) + ["core"])


if __name__ == "__main__":
  sys.exit(main())
