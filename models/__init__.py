"""The jaxdd model zoo (installed as ``jaxdd.models``): wrappers that follow the
:class:`jaxdd.BaseModel` protocol, each in a module named for its model."""
