"""The names lcap's DNS answered for addresses (`--transparent`), and the stand-in addresses it gave names the host
cannot resolve: filled by the DNS (capture/reach/dns.py), read by the front for a redirected connection's host name."""

from __future__ import annotations

import ipaddress
from collections import OrderedDict

STAND_IN = ipaddress.ip_network("198.18.0.0/15")
MAX_NAMES = 65536


class Names:
    """The names lcap answered for addresses, and the stand-in addresses of names the host cannot resolve."""

    def __init__(self, max_names: int = MAX_NAMES) -> None:
        self.max_names = max_names
        self._by_address: OrderedDict[str, str] = OrderedDict()
        self._stand_ins: OrderedDict[str, str] = OrderedDict()  # name -> address
        self._next = 1

    def name_of(self, address: str) -> str | None:
        return self._by_address.get(address)

    def is_stand_in(self, address: str) -> bool:
        try:
            return ipaddress.ip_address(address) in STAND_IN
        except ValueError:
            return False

    def remember(self, name: str, address: str) -> None:
        self._by_address[address] = name
        self._by_address.move_to_end(address)
        if len(self._by_address) > self.max_names:
            self._by_address.popitem(last=False)

    def stand_in(self, name: str) -> str:
        address = self._stand_ins.get(name)
        if address is None:
            if len(self._stand_ins) >= self.max_names:
                _, address = self._stand_ins.popitem(last=False)  # the oldest name gives its address up
            else:
                address = str(STAND_IN[self._next])
                self._next += 1
            self._stand_ins[name] = address
        self._stand_ins.move_to_end(name)
        self.remember(name, address)
        return address
