"""The workflow file: one pydantic model per section, recipes and grids as overrides of them,
validation errors that name the field and its line, and the ranking metric's syntax."""
