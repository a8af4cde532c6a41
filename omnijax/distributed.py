"""`omnijax.distributed`: meshes, shardings and multi-host start-up for `omnijax.evaluate` (a public name; the code is
`omnijax.eval.mesh`, and this module is that module)."""

import sys

from omnijax.eval import mesh

sys.modules[__name__] = mesh
