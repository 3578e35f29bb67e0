"""The D-Bus API as files: etc/dbus-1/interfaces/org.dsr1d.Manager1.xml and Engine1.xml are
exactly what the running daemon's introspection says (clients and bindings generators read the
files; a changed method, argument or property without the files fails here).

After an intended change: ``DSR1D_WRITE_INTERFACES=1 .venv/bin/python -m pytest
tests/test_introspection.py`` rewrites them from the daemon.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import BUS_NAME, busctl  # noqa: E402

pytest_plugins = ["daemon_fixtures"]

INTERFACES = Path(__file__).resolve().parent.parent / "etc/dbus-1/interfaces"
OBJECTS = {"org.dsr1d.Manager1": "/org/dsr1d", "org.dsr1d.Engine1": "/org/dsr1d/engine"}
HEADER = ('<!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN"\n'
          '"http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">\n')


def canonical(element: ET.Element) -> str:
    """The interface without whitespace between elements: what the API is, not its layout."""
    for e in element.iter():
        e.text = e.tail = None
    ET.indent(element, "  ")
    return ET.tostring(element, encoding="unicode")


def served(bus, name: str) -> ET.Element:
    proc = busctl(bus, "--xml-interface", "introspect", BUS_NAME, OBJECTS[name])
    assert proc.returncode == 0, proc.stderr
    (interface,) = [i for i in ET.fromstring(proc.stdout.split("\n", 2)[2]).iter("interface")
                    if i.get("name") == name]
    return interface


@pytest.mark.parametrize("name", list(OBJECTS))
def test_the_shipped_interface_is_what_the_daemon_serves(daemon, bus, name: str) -> None:
    live = canonical(served(bus, name))
    path = INTERFACES / f"{name}.xml"
    if os.environ.get("DSR1D_WRITE_INTERFACES") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        node = ET.Element("node")
        node.append(ET.fromstring(live))
        ET.indent(node, "  ")
        path.write_text(HEADER + ET.tostring(node, encoding="unicode") + "\n")
    (shipped,) = [i for i in ET.parse(path).getroot().iter("interface") if i.get("name") == name]
    assert canonical(shipped) == live, (
        f"{path.name} differs from the daemon's introspection; if the change is intended, "
        f"DSR1D_WRITE_INTERFACES=1 .venv/bin/python -m pytest tests/test_introspection.py")
