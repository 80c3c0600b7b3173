"""mf_tp: not implemented yet; this package is an importable shell until its issue lands."""

__all__: list[str] = []
