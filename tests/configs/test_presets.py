"""The server presets in configs/ can run side by side on one machine: no two open the same port."""

import glob
import os

import yaml

from jaxserve.server.config_file import load_config
from tests.distributed.launch import ROOT


def test_presets_load_and_open_distinct_ports():
    ports: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        with open(path) as f:
            tree = yaml.safe_load(f)
        if "router" in tree:  # the router's own sections: its ports come from the file as written
            named = {f"router.{key}": tree["router"][key] for key in ("port", "http_port", "metrics_port")}
        else:
            server = load_config(path).server  # defaults included: a port left unset still opens
            named = {f"server.{key}": getattr(server, key) for key in ("port", "http_port", "metrics_port")}
        for name, port in named.items():
            if port:
                assert port not in ports, f"{os.path.basename(path)} {name} {port} is also {ports[port]}"
                ports[port] = f"{os.path.basename(path)} {name}"
    assert len(ports) >= 9  # three presets, three ports each
