"""The built-in plugins. They use the same public API as third-party plugins and are
registered through the same ``composer_par.plugins`` entry points."""
