"""A synthetic English→German corpus that ships with the package, for configs/demo.yaml."""
