"""k3serve: serving platform for Kimi K3-class hybrid (KDA + MLA) models."""

__version__ = "0.1.0"


def _map_operator_namespace() -> None:
    """Editable installs only: setuptools' editable finder cannot resolve the namespace subpackage
    `k3serve.operator` (operator/ has no __init__.py on purpose), so map it to ../operator here.
    A wheel install has k3serve/operator/ inside the package and needs nothing."""
    import os
    import sys
    from importlib.machinery import ModuleSpec
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(os.path.dirname(here), "operator")
    if ("k3serve.operator" in sys.modules or os.path.isdir(os.path.join(here, "operator"))
            or not os.path.isdir(source)):
        return
    spec = ModuleSpec("k3serve.operator", None, is_package=True)
    spec.submodule_search_locations = [source]
    module = module_from_spec(spec)
    sys.modules["k3serve.operator"] = module
    globals()["operator"] = module  # the attribute `import k3serve.operator.x` expects on the parent


_map_operator_namespace()
