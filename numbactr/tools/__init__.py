"""numbactr.tools: hugectr.tools (DataGenerator, DataGeneratorParams)."""
from .data_generator import DataGenerator, DataGeneratorParams

__all__ = ["DataGenerator", "DataGeneratorParams"]
