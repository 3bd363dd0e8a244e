"""The runtime's name for :mod:`isthmus.layout.dims` (``ParallelDims``, ``check_layout``, the mesh)."""

from isthmus.layout.dims import FILL, MESH_DIMS, Meshes, ParallelDims, check_layout, fill_data_parallel

__all__ = ["FILL", "MESH_DIMS", "Meshes", "ParallelDims", "check_layout", "fill_data_parallel"]
