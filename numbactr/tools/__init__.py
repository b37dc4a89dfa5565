"""numbactr.tools: hugectr.tools (DataGenerator, DataGeneratorParams)."""

from numbactr.tools.data_generator import DataGenerator, DataGeneratorParams

__all__ = ["DataGenerator", "DataGeneratorParams"]
