"""vlcurate stages: one stage per file, plain classes, no ray imports (see stages/base.py)."""
