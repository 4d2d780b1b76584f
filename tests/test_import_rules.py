"""The package's layers, read off its imports: core <- front ends <- families <- public faces.

``core`` is framework-neutral (no front end, no family); ``linen`` and ``nnx`` find and
replay calls in their own Flax API and never import each other or a family; the families
(``interpret``, ``kfac``, ``per_example``) build on core and the front ends and not on each
other; no module imports a name another module keeps private.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'perturbkit'
FRONT_ENDS = ('linen', 'nnx')
FAMILIES = ('interpret', 'kfac', 'per_example')


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imports_of(path: pathlib.Path) -> list[tuple[str, str | None, int]]:
  """``(module, name or None, line)`` for each perturbkit import in the file."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found += [(a.name, None, node.lineno) for a in node.names if a.name.startswith('perturbkit')]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.startswith('perturbkit'):
        found += [(node.module, a.name, node.lineno) for a in node.names]
  return found


def layer(module: str) -> str:
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def edges():
  for path in sorted(PACKAGE.rglob('*.py')):
    source = module_name(path)
    for target, name, line in imports_of(path):
      yield source, target, name, f'{path.relative_to(PACKAGE.parent)}:{line}'


ALL_EDGES = list(edges())


def is_public_face(module: str) -> bool:
  """The package's and the front ends' ``__init__``: they gather the public names."""
  return module in ('perturbkit', 'perturbkit.nnx', 'perturbkit.linen')


def is_module(package: str, name: str) -> bool:
  base = PACKAGE.parent.joinpath(*package.split('.'))
  return (base / f'{name}.py').exists() or (base / name / '__init__.py').exists()


def core_reaches_out(source, target, name):
  return layer(source) == 'core' and layer(target) in (*FRONT_ENDS, *FAMILIES, 'demo')


def front_ends_cross(source, target, name):
  if is_public_face(source):
    return False
  a, b = layer(source), layer(target)
  return a in FRONT_ENDS and (b in FAMILIES or (b in FRONT_ENDS and b != a))


def families_cross(source, target, name):
  a, b = layer(source), layer(target)
  return a in FAMILIES and b in FAMILIES and a != b


def private_name(source, target, name):
  # A private module's public names are the package's internal API; a private
  # name inside another module is not.
  return name is not None and name.startswith('_') and not is_module(target, name)


def violations(rule):
  return [f'{where}: {source} imports {target}{"." + name if name else ""}'
          for source, target, name, where in ALL_EDGES if rule(source, target, name)]


def test_the_package_has_imports_to_check():
  assert len(ALL_EDGES) > 100
  assert {layer(s) for s, *_ in ALL_EDGES} >= {'core', *FRONT_ENDS, *FAMILIES}


@pytest.mark.parametrize('rule', [core_reaches_out, front_ends_cross, families_cross,
                                  private_name], ids=lambda r: r.__name__)
def test_import_rule(rule):
  assert violations(rule) == []


def test_the_rules_catch_a_violation():
  assert core_reaches_out('perturbkit.core._sweep', 'perturbkit.linen._driver', 'x')
  assert front_ends_cross('perturbkit.nnx._calls', 'perturbkit.linen._interceptor', 'point_key')
  assert front_ends_cross('perturbkit.linen._driver', 'perturbkit.kfac._layers', 'x')
  assert families_cross('perturbkit.kfac._examples', 'perturbkit.per_example._calls', 'x')
  assert private_name('perturbkit.kfac._nnx_estimator', 'perturbkit.kfac._estimator', '_split')
  assert not private_name('perturbkit', 'perturbkit.core', '_points')
