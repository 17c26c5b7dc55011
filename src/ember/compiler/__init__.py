"""The compiler: graph passes, fusion planning, scheduling and code generation."""
