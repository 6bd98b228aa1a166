// specee-options.h: the option tables' rows and the mode table's (specee-options.cpp); a value held to its row, and
// set or read as text, is specee-option-values.h's
#pragma once

#include "specee.h"

#include <cmath>
#include <cstddef>
#include <cstdint>

// One row of an option table: the public part (name, type, what it accepts, help, flags) and where the value lives
struct specee_option_row {
    specee_option       info;
    size_t              offset;       // of the value in the table's struct (specee_generator_params, _context_options)
    size_t              count_offset; // LIST / FLOATS: of its count
    const char * const * names;       // CHOICE: the names, by enum value
    int32_t             n_names;
    double              lo, hi;       // INT / FLOAT: the accepted range of a value; LIST / FLOATS: of each item
    int32_t             cap   = 0;    // FLOATS: the most values (0: SPECEE_MAX_DEVICES)
    double              unset = NAN;  // INT / FLOAT: the value outside the range that means "not set" (the default's)
    int32_t             open  = 0;    // SPECEE_OPEN_LO / _HI: that end of [lo, hi] is outside the range ((0, 1])
};

enum { SPECEE_OPEN_LO = 1, SPECEE_OPEN_HI = 2 };

struct specee_option_table {
    const specee_option_row * rows;
    int32_t                   n;
};

// the rows of specee_generator_params' options and of specee_context_options'
specee_option_table specee_generator_option_table();
specee_option_table specee_context_option_table();

// mode's row of the mode table (specee_mode_info); throws for an unknown mode
const specee_mode_info & specee_mode_row_impl(int32_t mode);
