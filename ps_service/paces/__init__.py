"""Communication paces: when buffered updates become a new global version.

One module per pace; each registers its class (``base.register``), and importing this
package imports them all. A new pace: a module here with a ``@register``-ed ``Pace``
subclass, and its import below (docs/PACES.md shows one).
"""

from ps_service.paces import acbsp, asp, bsp, ssp  # noqa: F401  (each registers its pace)
from ps_service.paces.acbsp import Acbsp
from ps_service.paces.asp import Asp
from ps_service.paces.base import DeviceRules, Pace, known, make_pace, register
from ps_service.paces.bsp import Bsp
from ps_service.paces.ssp import Ssp

__all__ = ["Acbsp", "Asp", "Bsp", "DeviceRules", "Pace", "Ssp", "known", "make_pace", "register"]
