"""Certificates: frozen, JSON-round-trippable records of every rewrite decision, with digests."""

from .codes import REGISTRY, Code, lookup
from .io import certificates_of, load, save
from .model import (DECISIONS, SCHEMA_VERSION, Certificate, Check, Guard, Site, Witness, decide,
                    jsonable)
from .render import render_certificate, render_certificates
from .summary import pass_counters

__all__ = [
    "Certificate", "Check", "Code", "DECISIONS", "Guard", "REGISTRY", "SCHEMA_VERSION", "Site",
    "Witness", "certificates_of", "decide", "jsonable", "load", "lookup", "pass_counters",
    "render_certificate", "render_certificates", "save",
]
