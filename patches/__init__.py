"""Per-architecture patches (installed as ``flexgroup.patches``)."""
